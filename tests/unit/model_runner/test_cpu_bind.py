"""``cpu_bind``: the compute threads' CPUs, from ``RunnerConfig.cpu_bind``, and ``kvmesh up``'s split."""

from __future__ import annotations

import pytest

from services.model_runner.config import RunnerConfig
from services.model_runner.cpu_bind import format_cpu_list, parse_cpu_list, resolve, split_for_suite


def test_a_cpu_list_reads_ranges_and_single_cpus_in_the_order_written() -> None:
    assert parse_cpu_list("0-2,5") == (0, 1, 2, 5)
    assert parse_cpu_list("3") == (3,)
    assert parse_cpu_list("6, 2-3") == (6, 2, 3)
    assert parse_cpu_list(format_cpu_list((7, 1, 4))) == (7, 1, 4)


@pytest.mark.parametrize(("text", "message"), [
    ("", "cpu_bind must be auto, none or a CPU list"),
    ("all", "cpu_bind must be auto, none or a CPU list"),
    ("0-", "cpu_bind must be auto, none or a CPU list"),
    ("-1", "cpu_bind must be auto, none or a CPU list"),
    ("3-1", "the range '3-1' runs backwards"),
    ("1,0-2", "cpu_bind lists a CPU twice"),
])  # fmt: skip
def test_a_malformed_cpu_list_is_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_cpu_list(text)


def test_the_config_refuses_a_bad_setting_and_a_list_the_team_does_not_fill() -> None:
    with pytest.raises(ValueError, match="cpu_bind must be auto, none or a CPU list"):
        RunnerConfig(model_dir="x", cpu_bind="fast")
    with pytest.raises(ValueError, match="cpu_bind lists 2 CPUs for a team of num_threads=1"):
        RunnerConfig(model_dir="x", cpu_bind="0,1", num_threads=1)
    assert RunnerConfig(model_dir="x", cpu_bind="0,1", num_threads=2).cpu_bind == "0,1"
    assert RunnerConfig(model_dir="x", cpu_bind="0-3").num_threads == 0  # the list sizes the team


def test_auto_binds_only_a_team_that_takes_every_allowed_cpu() -> None:
    assert resolve("auto", 0, (0, 1, 2, 3)) == (0, 1, 2, 3)
    assert resolve("auto", 4, (0, 1, 2, 3)) == (0, 1, 2, 3)
    # fewer threads than CPUs: which CPUs are free of other runners is not the runner's to know
    assert resolve("auto", 1, (0, 1)) == ()
    assert resolve("none", 0, (0, 1)) == ()


def test_a_list_binds_its_cpus_in_order_and_must_lie_in_the_allowed_ones() -> None:
    assert resolve("3,1", 2, (0, 1, 2, 3)) == (3, 1)
    assert resolve("2-3", 0, (0, 1, 2, 3)) == (2, 3)
    with pytest.raises(ValueError, match=r"cpu_bind lists CPUs \[4, 5\] that this process may not run on"):
        resolve("3-5", 0, (0, 1, 2, 3))


def test_kvmesh_up_gives_a_smaller_team_the_last_cpus_and_the_other_services_the_rest() -> None:
    assert split_for_suite("auto", 1, (0, 1)) == ("1", (0,))
    assert split_for_suite("auto", 2, (0, 1, 2, 3)) == ("2,3", (0, 1))
    assert split_for_suite("auto", 1, (5, 2, 9)) == ("9", (2, 5))
    # a team of every CPU, the default team, a user's list or none: nothing to split
    assert split_for_suite("auto", 2, (0, 1)) is None
    assert split_for_suite("auto", 0, (0, 1)) is None
    assert split_for_suite("1", 1, (0, 1)) is None
    assert split_for_suite("none", 1, (0, 1)) is None
