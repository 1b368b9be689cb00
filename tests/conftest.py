"""Test-wide setup.

NOTE: TRITON_INTERPRET must be set before any ``@triton.jit`` decorator runs, so it is set here,
at the top of the root conftest, before test modules import the kernels.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Suites started as processes run the exact mode (fp32) unless a test asks for another: their byte
# budgets (KV pool, DRAM tier) are counted in fp32 blocks and their answers are compared with
# transformers' fp32 generate(). `auto` (bf16 on a CPU with AVX512-BF16 or AMX) is tested where a
# test sets it (tests/integration/test_default_mode.py, the factory's selection tests).
os.environ.setdefault("KVMESH_RUNNER_DTYPE", "float32")
# Native CPU kernels are built once per machine into a test-only folder, not the user's cache.
os.environ.setdefault("KVMESH_NATIVE_CACHE", os.path.join(tempfile.gettempdir(), f"kvmesh-native-tests-{os.getuid()}"))


_CORPUS = [
    "The capital of France is Paris. The capital of Japan is Tokyo.",
    "KV caches keep keys and values of past tokens so decoding reads them instead of recomputing.",
    "Paged attention splits the cache into fixed-size blocks, like virtual memory pages.",
    "Héllo wörld — naïve café ünïcödé 日本語 テキスト 🙂 emoji!",
    "def hello(name):\n    return f'hello {name}'\n",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_checkpoint(folder: Path, arch: str = "llama", vocab_size: int = 384, seed: int = 0,
                          hidden_size: int = 64) -> Path:
    """A tiny random-weight HF checkpoint with a real byte-level BPE tokenizer and chat template.

    The tokenizer is trained on a few sentences in milliseconds (no download), so text prompts,
    chat templates and multi-byte characters go through the real tokenization code.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 8, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    common = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=fast.eos_token_id, bos_token_id=fast.bos_token_id, pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
    )
    model_type = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral"}[arch]
    config = AutoConfig.for_model(model_type, **common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    # Random init gives near-uniform logits; scaling up spreads them so greedy decoding is not a
    # string of near-ties (which would make token-identity tests flaky across kernels).
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama checkpoint + tokenizer, built once per test session."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_llama_hd32_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with head_dim 32 (hidden 128, 4 heads): the smallest head the native bf16
    attention dot products take (kv_elem.h's kv_bf16_dots; head_dim 16 reads a bf16 pool widened)."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama-hd32"), hidden_size=128)


@pytest.fixture(scope="session")
def postgres_url() -> str | None:
    """The PostgreSQL server the machines run (127.0.0.1:5432, trust auth, database test), or None.

    Tests that need it skip with a clear reason when it does not answer.
    """
    import psycopg

    for user in ("postgres", "root"):
        try:
            with psycopg.connect(f"host=127.0.0.1 port=5432 user={user} dbname=test", connect_timeout=2):
                return f"postgresql+psycopg://{user}@127.0.0.1:5432/test"
        except psycopg.Error:
            continue
    return None


REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture(scope="session")
def redis_url() -> str | None:
    """The Redis server the machines run (127.0.0.1:6379, database 0), or None.

    Tests that need it skip with a clear reason when it does not answer.
    """
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_timeout=2, socket_connect_timeout=2)
    try:
        client.ping()
    except (redis.RedisError, OSError):
        return None
    finally:
        client.close()
    return REDIS_URL


@pytest.fixture
def remote_prefix(redis_url: str | None) -> Iterator[str]:
    """A key prefix no other test uses in the shared Redis; its keys are deleted afterwards."""
    import uuid

    import redis

    if redis_url is None:
        pytest.skip("no Redis server answers at 127.0.0.1:6379")
    prefix = f"kvmesh-test:{uuid.uuid4().hex[:12]}:"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=prefix + "*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()
