"""Loading models from disk (HF directories, errors) and the in-process `specdec run` demo."""

import subprocess
import sys
from pathlib import Path

import pytest

from specdec.errors import ModelLoadError
from specdec.modeling.loading import load_model, load_tokenizer, resolve
from specdec.modeling.tiny import tiny_llama, word_tokenizer

SPECDEC = str(Path(sys.executable).with_name("specdec"))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    for name, seed, hidden in (("target", 1, 32), ("draft", 2, 16)):
        tiny_llama(24, seed=seed, hidden_size=hidden).save_pretrained(root / name)
        word_tokenizer(24).save_pretrained(root / name)
    return root


def test_resolve_errors_are_clear(tmp_path):
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        resolve(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        resolve(str(tmp_path))
    (tmp_path / "weights.bin").write_text("x")
    with pytest.raises(ModelLoadError, match="neither"):
        resolve(str(tmp_path / "weights.bin"))
    with pytest.raises(ModelLoadError, match="cannot load"):
        load_model("no-such-org/no-such-model", "cpu", quiet=True)


def test_default_target_resolves_to_the_shipped_gguf():
    source = resolve("smollm2")
    assert source.gguf_file and source.gguf_file.endswith(".gguf")
    assert Path(source.location, source.gguf_file).is_file()


def test_load_from_hf_directory(model_dirs):
    model = load_model(str(model_dirs / "target"), "cpu", quiet=True)
    assert model.config.vocab_size == 24 and not model.training
    assert load_tokenizer(str(model_dirs / "target")).decode([1, 2]) == "w1 w2"


def test_specdec_run_streams_an_answer_with_stats(model_dirs):
    proc = subprocess.run(
        [
            SPECDEC,
            "run",
            "w1 w2 w3 w1 w2",
            "--target-model",
            str(model_dirs / "target"),
            "--draft-model",
            str(model_dirs / "draft"),
            "-k",
            "3",
            "--fixed-k",  # speculation on, whatever the load-aware default would measure
            "--max-new-tokens",
            "12",
            "--seed",
            "5",
            "--compare",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "acceptance rate" in proc.stdout and "target passes" in proc.stdout
    assert "seed=5" in proc.stdout and "12 tokens" in proc.stdout
    # --compare: the same greedy request without speculation, same tokens, and the speed ratio
    assert "without speculation" in proc.stdout and "identical tokens: yes" in proc.stdout
    # then 8 concurrent streams of the same request, each with the lone stream's tokens
    assert "8 concurrent streams of the same request" in proc.stdout
    assert "streams with the lone stream's tokens: 8 of 8" in proc.stdout


def test_specdec_run_with_draft_none_does_not_speculate(model_dirs):
    # A repetitive prompt: an n-gram draft would propose here, so a silent fallback would show.
    proc = subprocess.run(
        [
            SPECDEC,
            "run",
            "w1 w2 w3 w1 w2 w3 w1 w2",
            "--target-model",
            str(model_dirs / "target"),
            "--draft-model",
            "none",
            "--max-new-tokens",
            "8",
            "--ignore-eos",
            "--seed",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "no speculation (target only)" in proc.stdout and "8 target passes" in proc.stdout, proc.stdout
    assert "starting draft replica" not in proc.stderr


def test_specdec_run_reports_a_missing_model_without_a_traceback(tmp_path):
    proc = subprocess.run(
        [SPECDEC, "run", "hi", "--target-model", str(tmp_path / "nope.gguf")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert "GGUF file not found" in proc.stderr and "Traceback" not in proc.stderr


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        for children in Path(f"/proc/{parent}/task").glob("*/children"):
            for child in children.read_text().split():
                if int(child) not in found:
                    found.add(int(child))
                    todo.append(int(child))
    return found


def _running(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def test_sigterm_to_specdec_run_stops_every_process_it_started(model_dirs):
    import signal
    import threading
    import time

    proc = subprocess.Popen(
        [
            SPECDEC,
            "run",
            "w1 w2",
            "--target-model",
            str(model_dirs / "target"),
            "--draft-model",
            str(model_dirs / "draft"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    log: list[str] = []
    try:
        for line in proc.stderr:  # the services are up; the coordinator (Ray) is starting
            log.append(line)
            if "starting coordinator" in line:
                break
        # keep reading: the children log to this same pipe, and a full pipe nobody drains blocks
        # their writes (and can abort the interpreter's shutdown), which is not what is tested here
        drain = threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True)
        drain.start()
        started = _descendants(proc.pid)
        assert len(started) >= 3  # redis-server, target, draft (and the coordinator's process tree)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
        drain.join(timeout=10)
        assert code == 130, "".join(log)[-3000:]
    finally:
        proc.kill()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_running(p) for p in started):
        time.sleep(0.5)
    assert not [p for p in started if _running(p)], "processes left behind after SIGTERM"


def test_an_invalid_head_vocabulary_is_a_clear_load_error(model_dirs, tmp_path):
    import shutil

    broken = tmp_path / "draft"
    shutil.copytree(model_dirs / "draft", broken)
    for content in ('{"token_ids": [1, 1]}', '{"token_ids": [99]}', "not json", "{}"):
        (broken / "head_vocab.json").write_text(content)
        with pytest.raises(ModelLoadError, match=r"head_vocab\.json is invalid"):
            load_model(str(broken), "cpu", quiet=True)


def test_local_stack_gives_the_draft_one_thread_unless_told_otherwise():
    from specdec.apps.launcher import draft_flags

    assert draft_flags(None) == ["--threads", "1"]
    assert draft_flags(["--device", "cpu"]) == ["--device", "cpu", "--threads", "1"]
    assert draft_flags(["--threads", "2"]) == ["--threads", "2"]


def test_a_command_imports_only_its_own_module():
    """`specdec distill` must work where only torch and transformers are installed (a GPU box),
    and a service process should not import the other services (ray for a draft replica)."""
    probe = (
        "import sys; from specdec.apps.cli import build_parser; "
        "args = build_parser('distill').parse_args(['distill', '--target', 't', '--out', 'o']); "
        "print(args.func.__module__, 'ray' in sys.modules, 'grpc' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["specdec.training.distill", "False", "False"]
    # Without a command every subcommand is complete (`specdec --help`, the deploy tests).
    from specdec.apps.cli import build_parser

    args = build_parser().parse_args(["target", "--port", "5"])
    assert args.port == 5 and args.func.__module__ == "replica.target"


def test_the_summary_line_says_how_much_of_the_prompt_came_from_the_prefix_cache():
    from specdec.apps.client import StreamedAnswer, summary
    from specdec.v1 import coordinator_pb2 as pb

    answer = StreamedAnswer(token_ids=[1, 2], seconds=1.0, first_token_seconds=0.1)
    answer.stats = pb.SpeculationStats(target_passes=2, cached_prompt_tokens=48)
    assert "time to first token 0.10s (48 prompt tokens from the prefix cache)" in summary(answer)
    answer.stats = pb.SpeculationStats(target_passes=2)
    assert "prefix cache" not in summary(answer)


def test_the_summary_line_says_how_many_blocks_drafted_ahead_were_used():
    from specdec.apps.client import StreamedAnswer, summary
    from specdec.v1 import coordinator_pb2 as pb

    answer = StreamedAnswer(token_ids=[1, 2, 3], seconds=1.0, first_token_seconds=0.1)
    answer.stats = pb.SpeculationStats(target_passes=2, drafts=2, proposed_tokens=4, predrafts=2, predraft_hits=1)
    assert "1 of 2 blocks drafted ahead used" in summary(answer)
    answer.stats = pb.SpeculationStats(target_passes=2, drafts=2, proposed_tokens=4)
    assert "drafted ahead" not in summary(answer)
