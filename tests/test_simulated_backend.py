import threading
import time

import pytest
from infergate.gpu.backend import BackendError, ContractError
from infergate.gpu.backends.simulated import SimulatedBackend, sim_output


def test_one_output_per_input_containing_the_input() -> None:
    backend = SimulatedBackend(latency_ms=0)
    inputs = [f"item {i} ünïcode" for i in range(100)]
    outputs = backend.infer(inputs)
    assert outputs == [sim_output(s) for s in inputs]
    assert all(s in out for s, out in zip(inputs, outputs, strict=True))
    assert sim_output("a") != sim_output("b")


@pytest.mark.parametrize("size", [0, 101])
def test_rejects_batches_outside_1_to_100(size: int) -> None:
    with pytest.raises(ContractError, match="1-100"):
        SimulatedBackend(latency_ms=0).infer(["x"] * size)


def test_takes_the_batch_time_whatever_the_batch_size() -> None:
    backend = SimulatedBackend(latency_ms=50)
    for size in (1, 100):
        started = time.monotonic()
        backend.infer(["x"] * size)
        assert time.monotonic() - started >= 0.05


def test_runs_one_batch_at_a_time() -> None:
    backend = SimulatedBackend(latency_ms=300)
    errors: list[Exception] = []
    running = threading.Thread(target=backend.infer, args=(["first"],))
    running.start()
    time.sleep(0.05)
    try:
        backend.infer(["second"])
    except ContractError as exc:
        errors.append(exc)
    running.join()
    assert len(errors) == 1
    assert "one batch at a time" in str(errors[0])


def test_fail_marker_fails_the_call_only_when_turned_on() -> None:
    backend = SimulatedBackend(latency_ms=0, fail_marker="__fail__")
    with pytest.raises(BackendError):
        backend.infer(["ok", "bad __fail__ input"])
    # Off by default: in a running stack any key could fail a worker at will.
    assert SimulatedBackend(latency_ms=0).infer(["__fail__", "__hang__"]) == [
        sim_output("__fail__"),
        sim_output("__hang__"),
    ]
