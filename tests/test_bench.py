"""`specdec bench --quick` runs end to end on tiny models and writes its JSON and plot (no speed
assertion here: speed is what the bench reports, never what a test asserts)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.apps.bench import Mode, Sample, predicted_speedup, summarize
from specdec.modeling.tiny import char_tokenizer, perturbed, tiny_llama, word_tokenizer

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_bench_quick_writes_json_and_plot(tmp_path):
    target = tiny_llama(32, seed=6, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, max_positions=512)
    for name, model in (("target", target), ("draft", perturbed(target, 0.04, seed=2))):
        model.save_pretrained(tmp_path / name)
        word_tokenizer(32).save_pretrained(tmp_path / name)
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = subprocess.run(
        [
            str(Path(sys.executable).with_name("specdec")),
            "bench",
            "--quick",
            "--target-model",
            str(tmp_path / "target"),
            "--draft-model",
            str(tmp_path / "draft"),
            "--num-prompts",
            "2",
            "--repeats",
            "1",
            "--concurrency",
            "1,2",
            "--sustained",
            "3",
            "--json",
            str(out),
            "--plot",
            str(png),
            "--log-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    for key in (
        "modes",
        "speedup_vs_target_only",
        "speedup_vs_hf_assisted",
        "acceptance_rate",
        "mean_accepted_length",
        "predicted_speedup",
        "overhead_fraction",
        "concurrency",
    ):
        assert key in report
    modes = {(m["mode"], m["k"], m["temperature"]) for m in report["modes"]}
    for mode in ("target-only", "hf-generate"):
        assert (mode, 0, 0.0) in modes and (mode, 0, 0.7) in modes
    for k in (2, 4):
        for mode in ("speculative", "speculative-ngram", "hf-assisted"):
            assert (mode, k, 0.0) in modes
    adaptive = next(m for m in report["modes"] if m["mode"] == "speculative-adaptive" and m["temperature"] == 0)
    assert adaptive["k"] == 2 and adaptive["predicted_speedup"] is None  # Leviathan's model is for a fixed k
    assert all(m["tokens_per_s"] > 0 for m in report["modes"])
    spec = next(m for m in report["modes"] if m["mode"] == "speculative" and m["k"] == 2 and m["temperature"] == 0)
    assert 0 <= spec["acceptance_rate"] <= 1 and spec["mean_accepted_length"] >= 1
    assert len(spec["acceptance_per_position"]) == 2 and spec["itl_s_p99"] >= spec["itl_s_p50"]
    assert {c["concurrency"] for c in report["concurrency"]} == {1, 2}
    swept = {(c["mode"], c["k"], c["temperature"]) for c in report["concurrency"]}
    for t in (0.0, 0.7):  # target-only, each fixed k and the server's default policy, at each setting
        assert {("target-only", 0, t), ("speculative", 2, t), ("speculative", 4, t)} <= swept
        assert any(mode == "speculative-default" and temp == t for mode, _, temp in swept)
    assert "speculative-default" in {m["mode"] for m in report["modes"]}
    for level in report["concurrency"]:
        # under load every stream has the tokens it has alone -- except seeded sampling under the
        # load-aware default, whose k (so its tokens) may follow the load (docs/goodput.md)
        if not (level["mode"] == "speculative-default" and level["temperature"] > 0):
            assert level["streams_changed_vs_alone"] == 0, level
        assert level["steps_speculating"] is not None
        # --sustained 3: each level drains 3 requests (at least the level's streams) per repeat
        assert level["streams"] == max(level["concurrency"], 3) * report["settings"]["repeats"]
        assert level["aggregate_tokens_per_s"] > 0 and level["itl_s_p99"] >= level["itl_s_p50"]
        assert level["ttft_s_p99"] >= level["ttft_s_p50"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "best:" in proc.stdout and "tok/s" in proc.stdout


# a vocabulary JSON can be written in (a grammar engine reads its byte-level tokenizer)
JSON_TOKENS = ["<eos>", "{", "}", '"', ":", ",", " ", "a", "b", "c", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9"]
JSON_TOKENS += [": ", ", ", '{"', '":', "ab", "ba"]


def test_bench_structured_compares_forced_runs_on_and_off_against_target_only(tmp_path):
    target = tiny_llama(len(JSON_TOKENS), seed=6, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    for name, model in (("target", target), ("draft", perturbed(target, 0.04, seed=2))):
        model.save_pretrained(tmp_path / name)
        tokenizer = char_tokenizer(JSON_TOKENS)
        tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        tokenizer.save_pretrained(tmp_path / name)
    schema = {
        "type": "object",
        "properties": {"a": {"enum": [1, 22, 3]}, "b": {"enum": ["ab", "c"]}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    workload = tmp_path / "workload.jsonl"
    workload.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "text": text, "schema": schema}) + "\n" for i, text in enumerate(["ab", "ba c"])
        )
    )
    out = tmp_path / "structured.json"
    proc = subprocess.run(
        [
            str(Path(sys.executable).with_name("specdec")),
            "bench",
            "--structured",
            str(workload),
            "--target-model",
            str(tmp_path / "target"),
            "--draft-model",
            str(tmp_path / "draft"),
            "--repeats",
            "2",
            "--default-k",
            "3",
            "--max-new-tokens",
            "24",
            "--json",
            str(out),
            "--log-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    modes = {(m["mode"], m["temperature"]): m for m in report["modes"]}
    assert set(modes) == {(mode, t) for mode in ("target-only", "speculative", "speculative+forced") for t in (0, 0.7)}
    assert report["greedy_differs_from_target_only"] == []
    for (mode, _), m in modes.items():
        assert m["outputs"] == 4 and m["complete_documents"] == 4  # every output a whole document
        assert (m["forced_share"] > 0) == (mode == "speculative+forced"), m
        assert (m["acceptance_rate"] is None) == (mode == "target-only"), m
    # forced runs take tokens off the passes: fewer passes per token than the draft proposing them
    assert (
        modes[("speculative+forced", 0)]["target_passes_per_token"]
        < modes[("speculative", 0)]["target_passes_per_token"]
    )
    assert "speculative+forced" in proc.stdout and "every mode's tokens equal target-only's" in proc.stdout


def test_summaries_and_the_leviathan_prediction():
    mode = Mode("speculative", 3, "draft_model")
    samples = [
        Sample(
            tokens=8,
            seconds=1.0,
            ttft=0.1,
            itl=[0.1] * 7,
            passes=3,
            drafts=3,
            proposed=9,
            accepted=5,
            per_position=[3, 2],
            draft_s=0.3,
            verify_s=0.5,
            server_s=1.0,
        )
    ]
    s = summarize(mode, 0.0, [samples])
    assert s["tokens_per_s"] == 8.0 and s["acceptance_rate"] == 5 / 9
    assert s["mean_accepted_length"] == (5 + 3) / 3 and s["acceptance_per_position"] == [1.0, 2 / 3]
    assert s["time_split"] == pytest.approx({"draft": 0.3, "verify": 0.5, "coordination_network": 0.2})
    base = {"verify_s_per_pass": 0.1}
    # a = 5/9, k = 3: (1 - a^4) / (1 - a) tokens per pass, for 3 * (0.3 / 9) + 0.5 / 3 seconds
    a = 5 / 9
    expected = ((1 - a**4) / (1 - a)) / ((3 * 0.3 / 9 + 0.5 / 3) / 0.1)
    assert predicted_speedup(s, base) == pytest.approx(expected)


def test_a_sustained_level_keeps_its_workers_busy_and_never_runs_more_at_once():
    import asyncio

    from specdec.apps.bench import level_requests
    from specdec.apps.bench_stream import drain

    assert [level_requests(level, 0) for level in (1, 4)] == [1, 4]  # one wave
    assert [level_requests(level, 8) for level in (1, 4, 16)] == [8, 8, 16]
    running, peak, order = 0, 0, []

    async def one(i):
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        order.append(i)
        await asyncio.sleep(0.001 * (i % 3))
        running -= 1
        return i * i

    assert asyncio.run(drain(10, 3, one)) == [i * i for i in range(10)]
    assert peak == 3 and sorted(order) == list(range(10)) and order[:3] == [0, 1, 2]


def test_k_lists_take_empty_and_refuse_what_is_not_a_k():
    from specdec.apps.bench import _ks

    assert _ks("1, 2,4") == [1, 2, 4] and _ks("") == [] and _ks("2,") == [2]
    for bad in ("two", "0", "-1", "1.5"):
        with pytest.raises(SystemExit, match=repr(bad)):
            _ks(bad)


def test_a_structured_workload_is_a_jsonl_of_schemas_or_one_schema_for_every_prompt(tmp_path):
    from specdec.apps.bench_structured import load_workload

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "text": "one"}\n{"id": "b", "text": "two"}\n')
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object"}')
    rows = load_workload(str(schema), str(prompts), None, None)
    assert [(r["id"], r["schema"]) for r in rows] == [("a", {"type": "object"}), ("b", {"type": "object"})]
    bundled = load_workload(str(Path(__file__).parents[1] / "benchmarks" / "structured.jsonl"), "", 2, None)
    assert len(bundled) == 2 and all(isinstance(r["schema"], dict) for r in bundled)
    for text, message in (('["not", "a schema"]', "not a JSON schema"), ("{oops", "is not JSON")):
        schema.write_text(text)
        with pytest.raises(SystemExit, match=message):
            load_workload(str(schema), str(prompts), None, None)
    with pytest.raises(SystemExit, match="have no schema object"):
        load_workload(str(prompts.rename(tmp_path / "rows.jsonl")), "", None, None)
    with pytest.raises(SystemExit, match="no file"):
        load_workload(str(tmp_path / "missing.json"), str(prompts), None, None)


def test_bench_burst_runs_the_sequence_with_the_default_and_target_only_interleaved(tmp_path):
    """specdec bench --burst: every level of every sequence in both modes, which goes first
    alternating; greedy streams of the default equal target-only's; the table names each level."""
    from specdec.apps.bench_burst import burst_levels, first_mode

    assert burst_levels("1,16, 1") == [1, 16, 1]
    for bad in ("", "1,0", "1,x"):
        with pytest.raises(SystemExit):
            burst_levels(bad)
    assert [first_mode(0, p) for p in range(3)] == ["speculative-default", "target-only", "speculative-default"]
    assert first_mode(1, 0) == "target-only"  # the next sequence starts the other way round

    target = tiny_llama(32, seed=6, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, max_positions=512)
    for name, model in (("target", target), ("draft", perturbed(target, 0.04, seed=2))):
        model.save_pretrained(tmp_path / name)
        word_tokenizer(32).save_pretrained(tmp_path / name)
    out = tmp_path / "burst.json"
    proc = subprocess.run(
        [
            str(Path(sys.executable).with_name("specdec")),
            "bench",
            "--burst",
            "1,3,1",
            "--num-prompts",
            "2",
            "--target-model",
            str(tmp_path / "target"),
            "--draft-model",
            str(tmp_path / "draft"),
            "--repeats",
            "2",
            "--temperatures",
            "0",
            "--max-new-tokens",
            "12",
            "--json",
            str(out),
            "--log-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["levels"] == [1, 3, 1] and report["sequences"] == 2
    for row, level in zip(report["rows"], [1, 3, 1], strict=True):
        assert row["level"] == level and row["streams"] == 2 * 2 * level  # waves of 2 x level, 2 sequences
        assert row["streams_unlike_target_only"] == 0
        assert len(row["ratio_per_sequence"]) == 2 and row["ratio"] > 0
    assert "burst: levels [1, 3, 1]" in proc.stdout


def test_the_burst_warm_up_sends_every_prompt_target_only_at_the_largest_level(monkeypatch):
    """Before the measured sequences, one target-only wave (the default's regime learns nothing
    from it) with every prompt at least once, at the largest level's concurrency: the first
    measured wave then pays no first prefills that a later one finds cached."""
    import asyncio

    from specdec.apps import bench_burst

    sent, running, peak = [], [0], [0]

    async def fake_stream_one(stub, request):
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        await asyncio.sleep(0.001)
        running[0] -= 1
        sent.append(request)

    def build(prompt, mode, temperature, max_new_tokens, seed, ignore_eos):
        return (prompt, mode, temperature, max_new_tokens)

    monkeypatch.setattr(bench_burst, "stream_one", fake_stream_one)
    prompts = [f"p{i}" for i in range(5)]
    asyncio.run(bench_burst.warm_up(None, prompts, 3, "target-only-mode", build))
    assert sorted(p for p, *_ in sent) == prompts  # each prompt once (5 > 3 streams)
    assert {(m, t, n) for _, m, t, n in sent} == {("target-only-mode", 0.0, bench_burst.WARM_UP_TOKENS)}
    assert peak[0] == 3
    sent.clear()
    asyncio.run(bench_burst.warm_up(None, prompts[:2], 4, "target-only-mode", build))
    assert sorted(p for p, *_ in sent) == ["p0", "p0", "p1", "p1"]  # the largest level's batch, prompts cycled
