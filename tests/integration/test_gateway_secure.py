"""The gateway in front of the secure suite (TLS on the scheduler's port, API keys): the client's
``Authorization`` header is what the real scheduler checks, so both protocols share one check."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import openai
import pytest

from shared.launcher import ServiceProcess

if TYPE_CHECKING:
    from conftest import SecureSuite

KEY = "sk-team-a-000000000001"
PROMPT = [5, 17, 33, 48, 90, 120, 7, 64, 200, 31, 11]


def test_keys_are_checked_by_the_scheduler_through_the_gateway(secure_suite: SecureSuite, tmp_path: Path) -> None:
    env = {"KVMESH_GATEWAY_SCHEDULER_ADDRESS": secure_suite.address, "KVMESH_TLS_CA": secure_suite.certs.ca,
           "KVMESH_TLS_CERT": "", "KVMESH_TLS_KEY": ""}
    with ServiceProcess("gateway", env=env, log_dir=str(tmp_path), startup_timeout=60) as gw:
        base = f"http://{gw.address}/v1"
        with secure_suite.client(KEY) as client:
            text, _, _ = client.complete(PROMPT, 5, ignore_eos=True)
        good = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0)
        model = good.models.list().data[0].id
        got = good.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert got.choices[0].text == text
        for key in ("sk-unknown-000000000000", "EMPTY"):
            with pytest.raises(openai.AuthenticationError) as err:
                openai.OpenAI(base_url=base, api_key=key, max_retries=0).completions.create(
                    model=model, prompt=PROMPT, max_tokens=2)
            assert err.value.status_code == 401 and err.value.type == "authentication_error"
        with pytest.raises(openai.AuthenticationError):  # the model list is asked with the caller's key too
            openai.OpenAI(base_url=base, api_key="EMPTY", max_retries=0).models.list()
