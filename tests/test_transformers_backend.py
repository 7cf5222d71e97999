"""The real backend on a tiny GPT-2 built on disk. Skips without torch and
transformers (the optional ``torch`` extra); the CUDA test skips without a GPU."""

import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from infergate.gpu.backend import BackendError, ContractError  # noqa: E402
from infergate.gpu.backends.transformers_backend import TransformersBackend  # noqa: E402
from infergate.gpu.tiny_model import build_tiny_gpt2  # noqa: E402


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_gpt2(tmp_path_factory.mktemp("tiny-gpt2"))


@pytest.fixture(scope="module")
def backend(tiny_model: Path) -> TransformersBackend:
    return TransformersBackend(str(tiny_model), max_new_tokens=4, device="cpu")


def test_one_output_per_input_deterministic(backend: TransformersBackend) -> None:
    inputs = ["hello world", "the quick brown fox", "a"]
    outputs = backend.infer(inputs)
    assert len(outputs) == 3
    assert all(isinstance(o, str) for o in outputs)
    assert backend.infer(inputs) == outputs


def test_each_output_in_a_batch_of_mixed_lengths_equals_its_output_alone(
    backend: TransformersBackend,
) -> None:
    # Left padding and the attention mask must make a batch neighbour invisible:
    # the short inputs are padded by many tokens next to the long one.
    inputs = [
        "a",
        "the quick brown fox jumps over the lazy dog " * 6,
        "hello world",
        "lorem ipsum dolor sit amet, consectetur adipiscing elit",
        "x y",
    ]
    together = backend.infer(inputs)
    alone = [backend.infer([text])[0] for text in inputs]
    assert together == alone
    assert len(set(alone)) > 1  # the model really does tell them apart


def test_counting_never_touches_the_tokenizer_a_batch_is_encoded_with(
    backend: TransformersBackend,
) -> None:
    """A worker counts and cuts outputs (``clip``) on its event loop while
    the backend thread encodes the next batch: a tokenizer call sets its
    Rust tokenizer's padding, so one shared tokenizer would unpad a batch
    now and then (ValueError: unable to create tensor)."""
    encoding = backend.tokenizer
    calls = []
    original = type(encoding).__call__

    def counted(self: object, *args: object, **kwargs: object) -> object:
        if self is encoding:
            calls.append(args)
        return original(self, *args, **kwargs)  # type: ignore[arg-type]

    type(encoding).__call__ = counted  # type: ignore[method-assign]
    try:
        cut, count = backend.clip("the quick brown fox", 2)
        assert count == 2
        assert "the quick brown fox".startswith(cut)
        assert backend.clip("the quick brown fox", 0)[1] > 2
        assert calls == []
        backend.infer(["the quick brown fox"])
        assert len(calls) == 1  # (the batch is still encoded by it)
    finally:
        type(encoding).__call__ = original  # type: ignore[method-assign]


def test_a_full_batch_of_100(backend: TransformersBackend) -> None:
    assert len(backend.infer([f"input number {i}" for i in range(100)])) == 100


@pytest.mark.parametrize("size", [0, 101])
def test_rejects_batches_outside_1_to_100(backend: TransformersBackend, size: int) -> None:
    with pytest.raises(ContractError):
        backend.infer(["x"] * size)


def test_one_call_at_a_time(tiny_model: Path) -> None:
    slow = TransformersBackend(str(tiny_model), max_new_tokens=64, device="cpu")
    first = threading.Thread(target=slow.infer, args=([f"long {i}" for i in range(100)],))
    first.start()
    deadline = time.monotonic() + 10
    while not slow._one_at_a_time.locked():  # wait (bounded) until the first call runs
        assert time.monotonic() < deadline
        time.sleep(0.001)
    with pytest.raises(ContractError, match="one batch at a time"):
        slow.infer(["second"])
    first.join()


def test_an_input_past_the_models_positions_is_cut_to_fit(tiny_model: Path) -> None:
    backend = TransformersBackend(
        str(tiny_model), max_new_tokens=4, max_input_tokens=1000, device="cpu"
    )
    # Longer than the model's 256 positions: cut to what leaves room for the output.
    assert backend.max_input_tokens == 256 - 4
    assert len(backend.infer(["the quick brown fox " * 200, "short"])) == 2


def test_model_failures_become_backend_errors(tiny_model: Path) -> None:
    broken = TransformersBackend(str(tiny_model), max_new_tokens=4, device="cpu")

    def fails(**kwargs: object) -> None:
        raise RuntimeError("CUDA error: device-side assert triggered")

    broken.model.generate = fails
    with pytest.raises(BackendError, match="model call failed"):
        broken.infer(["anything"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_runs_on_cuda(tiny_model: Path) -> None:
    gpu = TransformersBackend(str(tiny_model), max_new_tokens=4)
    assert gpu.device == "cuda"
    assert next(gpu.model.parameters()).device.type == "cuda"
    assert len(gpu.infer([f"gpu {i}" for i in range(100)])) == 100


def test_a_transformers_worker_serves_http_end_to_end(
    tiny_model: Path, tmp_path: Path, redis_url: str
) -> None:
    from infergate.base.ports import free_port

    from tests.helpers import Proc, auth, http, policy_yaml, wait_for

    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_yaml())
    port = free_port()
    env = {"REDIS_URL": redis_url}
    procs = [
        Proc(
            [
                "worker",
                "--backend",
                "transformers",
                "--model",
                str(tiny_model),
                "--max-new-tokens",
                "4",
            ],
            env,
            tmp_path / "w.log",
        ),
        Proc(["dispatcher"], env, tmp_path / "d.log"),
        Proc(["gateway", "--port", str(port), "--policy", str(policy)], env, tmp_path / "g.log"),
    ]
    url = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            for p in procs:
                assert p.alive(), p.output()
            try:
                return http("GET", url + "/readyz", timeout=1)[0] == 200
            except OSError:
                return False

        wait_for(ready, 60, "a transformers worker to be ready")
        status, _, body = http(
            "POST", url + "/v1/inference", {"input": "hello world"}, auth("paid")
        )
        assert status == 200, body
        assert isinstance(body["output"], str)
        assert body["batch_size"] == 1
    finally:
        for p in procs:
            p.stop()


def test_up_gives_each_transformers_worker_its_own_gpu(
    tiny_model: Path, tmp_path: Path, redis_url: str
) -> None:
    """No GPU here: the check is the environment `up` gives each worker (each
    sees one device as cuda:0), and that the stack serves (on the CPU)."""
    from tests.helpers import Stack, children_of, cmdline, policy_yaml, wait_for

    s = Stack(
        tmp_path,
        redis_url,
        workers=3,
        policy=policy_yaml(),
        extra_args=[
            "--backend",
            "transformers",
            "--model",
            str(tiny_model),
            "--gpus",
            "0,1,2",
        ],
    )
    try:

        def worker_envs() -> list[str]:
            envs = []
            for pid in children_of(s.proc.proc.pid):
                if "infergate worker" in cmdline(pid):
                    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                    envs += [e.decode() for e in environ if e.startswith(b"CUDA_VISIBLE_DEVICES=")]
            return envs

        envs = wait_for(lambda: len(worker_envs()) == 3 and worker_envs(), 10, "three workers")
        assert sorted(envs) == [f"CUDA_VISIBLE_DEVICES={i}" for i in range(3)]
        status, _, body = s.infer("paid", "hello gpus")
        assert status == 200, body
    finally:
        s.stop()


def test_each_row_is_sampled_at_its_own_temperature(tiny_model: Path) -> None:
    backend = TransformersBackend(str(tiny_model), max_new_tokens=6, device="cpu")
    greedy = backend.infer(["hello world"])[0]
    rows = backend.infer_sampled(["hello world"] * 6, [0.0, 2.0, 2.0, 2.0, 2.0, 2.0])
    assert rows[0] == greedy  # a row at 0 decodes greedily beside sampled ones
    assert len(set(rows[1:])) > 1  # random weights at temperature 2: draws differ
    text, tokens = backend.clip(greedy, 2)
    assert tokens <= 2
    assert greedy.startswith(text)


def test_a_call_whose_requests_all_ask_for_few_tokens_stops_there(tiny_model: Path) -> None:
    """Requests that all ask for a few tokens: the call makes those (and
    enough more to end a character), the beginning of what it makes when
    one asks for none and runs to the model's bound; a row beside it that
    asks for a few still stops at its own."""
    from infergate.gpu.backend import Prompts

    backend = TransformersBackend(str(tiny_model), max_new_tokens=32, device="cpu")
    texts = ["hello world", "the quick brown fox"]
    short = backend.infer(Prompts(texts, texts, max_tokens=[1, 2]))
    whole = backend.infer(Prompts(texts, texts, max_tokens=[0, 2]))
    assert len(short[0]) < len(whole[0])
    assert whole[0].startswith(short[0].rstrip("\ufffd"))
    assert whole[1] == short[1]


def test_a_clip_never_splits_a_character(backend: TransformersBackend) -> None:
    """A byte-level tokenizer spreads a character over several tokens: a cut
    among them steps back to the character's start, so the clipped text is
    the output's own beginning, never a replacement character."""
    for text in ["ab😀cd", "é😀é", "x\U0001f9d1\u200d\U0001f680y", "ok"]:
        for limit in range(1, 12):
            clipped, tokens = backend.clip(text, limit)
            assert tokens <= limit
            assert text.startswith(clipped), (text, limit, clipped)
            assert "\ufffd" not in clipped


def test_a_chat_goes_through_the_tokenizers_own_template(tiny_model: Path) -> None:
    """A chat request's messages are rendered by the tokenizer's chat
    template where it has one (the gateway's rendering otherwise)."""
    from infergate.gpu.backend import Prompts

    backend = TransformersBackend(str(tiny_model), max_new_tokens=2, device="cpu")
    assert backend.chat_template is None  # (the tiny tokenizer has none)
    conversation = '[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}]'
    inputs = Prompts(["hi", "plain"], ["a", "b"], conversations=[conversation, None])
    assert backend._prompts(inputs) == ["hi", "plain"]
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    backend.tokenizer.chat_template = backend.chat_template = template
    assert backend._prompts(inputs) == ["<system>be brief<user>hi<assistant>", "plain"]
    assert len(backend.infer(inputs)) == 2


def test_a_chat_the_template_refuses_is_that_input_s_failure(tiny_model: Path) -> None:
    """A template that refuses a conversation (roles that do not alternate)
    fails the call as a BackendError: the worker's split answers the rest."""
    from infergate.gpu.backend import BackendError, Prompts

    backend = TransformersBackend(str(tiny_model), max_new_tokens=2, device="cpu")
    template = (
        "{% for m in messages %}{% if loop.index0 % 2 == 0 and m.role != 'user' %}"
        "{{ raise_exception('roles must alternate') }}{% endif %}{{ m.content }}{% endfor %}"
    )
    backend.tokenizer.chat_template = backend.chat_template = template
    refused = '[{"role":"assistant","content":"first"}]'
    inputs = Prompts(["first", "plain"], ["a", "b"], conversations=[refused, None])
    with pytest.raises(BackendError, match="chat template refuses this conversation"):
        backend.infer(inputs)
    assert len(backend.infer(Prompts(["plain"], ["b"], conversations=[None]))) == 1


def test_each_row_stops_at_its_own_most_so_a_call_ends_with_its_longest_answer(
    tiny_model: Path,
) -> None:
    """A row that asks for 2 tokens beside one that asks for 40 and ends
    its answer at once: the call runs a few steps, not 43 (before, the short
    row made all 43, for nothing: its output is cut to its 2), and the
    worker's count of the call's steps (its longest answer) is the steps
    it ran."""
    from infergate.gpu.backend import Prompts

    backend = TransformersBackend(str(tiny_model), max_new_tokens=64, device="cpu")
    texts = ["hello world", "the quick brown fox"]
    # (the first text's first new token made its end of text: its answer ends at once)
    prompt = backend.tokenizer(texts[:1], return_tensors="pt")
    first = backend.model.generate(**prompt, max_new_tokens=1, do_sample=False)[0, -1]
    backend.model.generation_config.eos_token_id = int(first)
    steps = 0

    def counted(*_: object) -> None:
        nonlocal steps
        steps += 1

    backend.model.register_forward_pre_hook(counted)
    alone = backend.infer(Prompts(texts[1:], [0], max_tokens=[2]))
    steps = 0
    both = backend.infer(Prompts(texts, [0, 1], max_tokens=[40, 2]))
    assert steps <= 2 + 3, steps  # (its 2, and enough more to end a character; before: 43)
    assert both[1] == alone[0]


def test_a_model_that_searches_beams_stops_each_row_at_its_own_too(tiny_model: Path) -> None:
    """A model's own generation config may search beams (a row per beam)."""
    from infergate.gpu.backend import Prompts

    backend = TransformersBackend(str(tiny_model), max_new_tokens=32, device="cpu")
    backend.model.generation_config.num_beams = 2
    texts = ["hello world", "the quick brown fox"]
    both = backend.infer(Prompts(texts, [0, 1], max_tokens=[2, 0]))
    alone = backend.infer(Prompts(texts[:1], [0], max_tokens=[2]))
    assert both[0] == alone[0]
    assert len(both[1]) > len(both[0])
