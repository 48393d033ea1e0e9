"""The checked-in generated modules (specdec/v1) are exactly what the .proto files generate."""

import filecmp

from specdec.apps.protogen import ROOT, generate, proto_files


def test_generated_modules_are_up_to_date(tmp_path):
    generate(tmp_path)
    names = sorted(p.name for p in (tmp_path / "specdec" / "v1").iterdir())
    assert names, "protoc generated nothing"
    for name in names:
        fresh = tmp_path / "specdec" / "v1" / name
        checked_in = ROOT / "specdec" / "v1" / name
        assert checked_in.exists(), f"{name} is not checked in: run python -m specdec.apps.protogen"
        assert filecmp.cmp(fresh, checked_in, shallow=False), f"{name} is stale: run python -m specdec.apps.protogen"


def test_public_api_names_are_pinned():
    from specdec.v1 import coordinator_pb2 as pb

    service = pb.DESCRIPTOR.services_by_name["Coordinator"]
    assert pb.DESCRIPTOR.package == "specdec.v1"
    assert {m.name: (m.input_type.name, m.output_type.name, m.server_streaming) for m in service.methods} == {
        "Generate": ("GenerateRequest", "GenerateResponse", False),
        "GenerateStream": ("GenerateRequest", "GenerateChunk", True),
    }
    fields = lambda msg: {f.name for f in getattr(pb, msg).DESCRIPTOR.fields}  # noqa: E731
    assert {"request_id", "prompt", "prompt_token_ids", "sampling", "speculation"} <= fields("GenerateRequest")
    assert fields("SamplingParams") >= {
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "max_new_tokens",
        "stop",
        "ignore_eos",
        "stop_token_ids",
    }
    assert fields("SpeculationParams") == {
        "num_speculative_tokens",
        "method",
        "adaptive",
        "replayable",
        "forced_tokens",
        "pipeline",
    }
    assert "cache_salt" in fields("GenerateRequest") and "invariant" in fields("SamplingParams")
    assert fields("GenerateResponse") >= {"request_id", "token_ids", "text", "finish_reason", "seed", "stats"}
    assert "prompt_tokens" in fields("GenerateResponse") and "prompt_tokens" in fields("GenerateChunk")
    assert {"messages", "apply_chat_template"} <= fields("GenerateRequest")
    assert fields("ChatMessage") == {"role", "content"}
    assert {"token_ids", "text", "finish_reason", "seed", "stats"} <= fields("GenerateChunk")
    assert {
        "target_passes",
        "proposed_tokens",
        "accepted_tokens",
        "accepted_per_position",
        "draft_seconds",
        "verify_seconds",
        "total_seconds",
        "forced_tokens",
        "predrafts",
        "predraft_hits",
        "predraft_seconds",
    } <= fields("SpeculationStats")
    assert len(proto_files()) == 4
