"""`mg-run`: serves prompts and JSONL; bad input is one clear line (or one error record), never a traceback."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from mg.manifests import constants as C
from mg.runtime.cli import main


def _run(args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def _error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("mg-run: error:")]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


@pytest.fixture()
def artifact_copy(tmp_path, tiny_seq_artifact):
    dst = tmp_path / "art"
    shutil.copytree(tiny_seq_artifact, dst)
    return dst


def _write_jsonl(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_prompts_and_jsonl_are_served_with_a_summary(tmp_path, tiny_seq_artifact):
    reqs = _write_jsonl(tmp_path / "in.jsonl", [{"id": "t", "tokens": [1, 5, 6]},
                                                {"id": "p", "prompt": "def f(x):", "max_new_tokens": 3}])
    out = tmp_path / "out.jsonl"
    code, stdout, stderr = _run([tiny_seq_artifact, "--prompt", "hello", "--input", reqs, "--max-new-tokens", "4",
                                 "--output", out, "--stats-json", tmp_path / "stats.json"])
    assert code == 0, stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in records) == ["p", "prompt-0", "t"]
    assert all(r["finish_reason"] in ("length", "eos") and "text" in r for r in records)
    assert len({r["id"]: r for r in records}["p"]["tokens"]) <= 3
    assert "kBatchedSequence" in stderr and "tokens/s" in stderr
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["requests"] == 3 and stats["layout"] == "sequence"


def test_overlap_flag_gives_the_same_tokens_and_says_how_many_steps_overlapped(tmp_path, tiny_seq_artifact):
    outputs = {}
    for flag in ("--overlap", "--no-overlap"):
        out = tmp_path / f"{flag}.jsonl"
        code, _, stderr = _run([tiny_seq_artifact, "--prompt", "def f(x):", "--prompt", "import os",
                                "--max-new-tokens", "12", "--output", out, "--stats-json", tmp_path / "stats.json",
                                flag])
        assert code == 0, stderr
        outputs[flag] = sorted((r["id"], r["tokens"]) for r in map(json.loads, out.read_text().splitlines()))
        overlapped = json.loads((tmp_path / "stats.json").read_text())["overlapped_steps"]
        assert (overlapped > 0 and "steps overlapped" in stderr) if flag == "--overlap" else overlapped == 0
    assert outputs["--overlap"] == outputs["--no-overlap"]


def test_no_requests_prints_usage(tiny_seq_artifact):
    code, _, stderr = _run([tiny_seq_artifact])
    assert code == 2 and "Usage:" in stderr and "nothing to do" in _error_line(stderr)


@pytest.mark.parametrize("flags,needle", [
    (["--temperature", "-1"], "--temperature=-1.0 is invalid"),
    (["--top-p", "1.5"], "--top-p=1.5 is invalid"),
    (["--top-k", "-2"], "--top-k=-2 is invalid"),
    (["--max-new-tokens", "0"], "--max-new-tokens is 0"),
    (["--device", "tpu"], "--device is 'tpu'"),
])
def test_invalid_flags_are_one_line(tiny_seq_artifact, flags, needle):
    code, _, stderr = _run([tiny_seq_artifact, "--prompt", "x"] + flags)
    assert code == 2 and needle in _error_line(stderr)


def test_other_layout_at_run_time_is_refused(tiny_seq_artifact):
    code, _, stderr = _run([tiny_seq_artifact, "--prompt", "x", "--kv-layout", "cell"])
    assert code == 2 and "fixed at export" in _error_line(stderr)


def test_missing_program_is_refused(artifact_copy):
    (artifact_copy / C.PROGRAM_FILE).unlink()
    code, _, stderr = _run([artifact_copy, "--prompt", "x"])
    assert code == 2 and "model.pte: file not found" in _error_line(stderr)


def test_corrupt_program_is_refused(artifact_copy):
    pte = artifact_copy / C.PROGRAM_FILE
    pte.write_bytes(pte.read_bytes()[: pte.stat().st_size // 3])
    code, _, stderr = _run([artifact_copy, "--prompt", "x"])
    assert code == 2 and "model.pte" in _error_line(stderr)


def test_corrupt_program_with_matching_manifest_is_refused_by_the_loader(artifact_copy):
    import hashlib

    pte = artifact_copy / C.PROGRAM_FILE
    data = b"\x00" * 64 + pte.read_bytes()[64:1000]
    pte.write_bytes(data)
    m = json.loads((artifact_copy / C.MANIFEST_FILE).read_text())
    for f in m["files"]:
        if f["name"] == C.PROGRAM_FILE:
            f["size"], f["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (artifact_copy / C.MANIFEST_FILE).write_text(json.dumps(m))
    code, _, stderr = _run([artifact_copy, "--prompt", "x"])
    assert code == 2 and "model.pte" in _error_line(stderr)


def test_manifest_disagreeing_with_the_program_is_refused_naming_both_values(artifact_copy):
    m = json.loads((artifact_copy / C.MANIFEST_FILE).read_text())
    m["kv"]["max_seqs"] = 5
    (artifact_copy / C.MANIFEST_FILE).write_text(json.dumps(m))
    code, _, stderr = _run([artifact_copy, "--prompt", "x"])
    line = _error_line(stderr)
    assert code == 2 and "get_offgraph_kv_max_seqs" in line and "returns 3" in line and "says 5" in line


def test_bad_requests_fail_alone_while_others_complete(tmp_path, tiny_seq_artifact):
    reqs = _write_jsonl(tmp_path / "in.jsonl", [
        {"id": "good", "tokens": [1, 5, 6]},
        "{this is not json",
        {"id": "vocab", "tokens": [1, 100000]},
        {"id": "long", "tokens": [5] * 200},
        {"id": "temp", "tokens": [1, 5], "temperature": -1},
        {"id": "eos", "tokens": [1, 5], "ignore_eos": "yes"},
        {"id": "good2", "prompt": "abc"},
        {"id": "all", "tokens": [1, 5], "ignore_eos": True},
    ])
    code, stdout, stderr = _run([tiny_seq_artifact, "--input", reqs, "--max-new-tokens", "3"])
    records = {r["id"]: r for r in map(json.loads, stdout.splitlines())}
    assert code == 1 and "Traceback" not in stderr
    assert records["good"]["finish_reason"] and records["good2"]["finish_reason"]
    assert "not valid JSON" in records[f"{reqs}:2"]["error"]  # a line without an id is named like its errors
    assert "outside the vocabulary" in records["vocab"]["error"]
    assert "exceeds the artifact's context capacity" in records["long"]["error"]
    assert "temperature" in records["temp"]["error"]
    assert "'ignore_eos' must be true or false" in records["eos"]["error"]
    assert records["all"]["finish_reason"] == "length" and len(records["all"]["tokens"]) == 3


def test_input_id_clashing_with_a_prompt_id_is_refused_before_any_work(tmp_path, tiny_seq_artifact):
    reqs = _write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "tokens": [1, 5]}, {"id": "prompt-0", "tokens": [1, 6]}])
    out = tmp_path / "out.jsonl"
    code, stdout, stderr = _run([tiny_seq_artifact, "--prompt", "x", "--input", reqs, "--output", out])
    line = _error_line(stderr)
    assert code == 2 and "'prompt-0' is also the id of --prompt 0" in line
    assert not out.exists() and stdout == ""


def test_engine_refuses_duplicate_ids(tiny_seq_artifact):
    from mg.runtime.artifact import load_artifact
    from mg.runtime.engine import Engine
    from mg.runtime.scheduler import Request

    engine = Engine(load_artifact(tiny_seq_artifact))
    with pytest.raises(ValueError, match="'x' appears more than once"):
        engine.run([Request("x", (1, 5), 2), Request("x", (1, 6), 2)])
    assert engine.scheduler.idle and engine.stats.steps == 0


def test_empty_prompts_are_refused_as_text_and_as_tokens(tmp_path, tiny_seq_artifact):
    reqs = _write_jsonl(tmp_path / "in.jsonl", [{"id": "text", "prompt": ""}, {"id": "ids", "tokens": []},
                                                {"id": "bos", "tokens": [1]}])
    code, stdout, stderr = _run([tiny_seq_artifact, "--input", reqs, "--max-new-tokens", "2"])
    records = {r["id"]: r for r in map(json.loads, stdout.splitlines())}
    assert code == 1
    assert "the prompt is empty" in records["text"]["error"] and "the prompt is empty" in records["ids"]["error"]
    assert records["bos"]["finish_reason"]  # generating from BOS alone is asked for explicitly
    code, _, stderr = _run([tiny_seq_artifact, "--prompt", "ok", "--prompt", ""])
    assert code == 2 and "--prompt 1: the prompt is empty" in _error_line(stderr)


def test_results_stream_as_requests_finish(tmp_path, tiny_seq_artifact):
    reqs = _write_jsonl(tmp_path / "in.jsonl", [{"id": "long", "tokens": [1, 5, 6], "max_new_tokens": 30,
                                                 "ignore_eos": True},
                                                {"id": "short", "tokens": [1, 7], "max_new_tokens": 1},
                                                "{bad"])
    out = tmp_path / "out.jsonl"
    code, _, stderr = _run([tiny_seq_artifact, "--input", reqs, "--output", out])
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert code == 1 and ids == [f"{reqs}:3", "short", "long"]  # the bad line at once, then finishing order


def test_dash_means_stdin_and_stdout(tiny_seq_artifact):
    result = CliRunner().invoke(main, [str(tiny_seq_artifact), "--input", "-", "--output", "-",
                                       "--max-new-tokens", "2"], input='{"id": "a", "tokens": [1, 5]}\n')
    assert result.exit_code == 0, result.stderr
    assert [json.loads(line)["id"] for line in result.stdout.splitlines()] == ["a"]


@pytest.mark.parametrize("flag", ["--output", "--stats-json"])
def test_outputs_inside_an_artifact_or_a_missing_folder_are_refused(tmp_path, artifact_copy, flag):
    before = {p.name: p.read_bytes() for p in artifact_copy.iterdir()}
    for path, needle in ((artifact_copy / C.MANIFEST_FILE, "is inside the artifact directory"),
                         (artifact_copy / "results.jsonl", "is inside the artifact directory"),
                         (tmp_path / "missing" / "out.jsonl", "does not exist; create it first"),
                         (tmp_path, "is a directory")):
        code, _, stderr = _run([artifact_copy, "--prompt", "x", flag, path])
        assert code == 2 and needle in _error_line(stderr)
    assert {p.name: p.read_bytes() for p in artifact_copy.iterdir()} == before
    assert not (tmp_path / "missing").exists()


def test_a_run_that_cannot_start_leaves_the_output_file_alone(tmp_path, tiny_seq_artifact):
    out = tmp_path / "out.jsonl"
    out.write_text("earlier results\n")
    code, _, stderr = _run([tmp_path / "no-such-artifact", "--prompt", "x", "--output", out])
    assert code == 2 and out.read_text() == "earlier results\n"


def test_sampled_requests_get_a_fresh_reported_seed_that_reproduces_them(tiny_seq_artifact):
    args = [tiny_seq_artifact, "--prompt", "def f(x):", "--temperature", "1.0", "--max-new-tokens", "12"]
    lines = [json.loads(_run(args)[1]) for _ in range(2)]
    assert all(isinstance(r["seed"], int) for r in lines) and lines[0]["seed"] != lines[1]["seed"]
    again = json.loads(_run(args + ["--seed", str(lines[0]["seed"])])[1])
    assert again["tokens"] == lines[0]["tokens"] and again["seed"] == lines[0]["seed"]
    greedy = json.loads(_run([tiny_seq_artifact, "--prompt", "def f(x):", "--max-new-tokens", "2"])[1])
    assert "seed" not in greedy


def test_version_and_threads(tiny_seq_artifact):
    from mg.export.cli import main as export_main

    for cli, name in ((main, "mg-run"), (export_main, "mg-export")):
        result = CliRunner().invoke(cli, ["--version"])
        assert result.exit_code == 0 and result.output.startswith(f"{name}, version ")
    import torch

    threads = torch.get_num_threads()
    try:
        code, stdout, stderr = _run([tiny_seq_artifact, "--prompt", "x", "--max-new-tokens", "2", "--threads", "1"])
        assert code == 0, stderr
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)  # the CLI ran in this process
    code, _, stderr = _run([tiny_seq_artifact, "--prompt", "x", "--threads", "0"])
    assert code == 2 and "--threads is 0" in _error_line(stderr)


@pytest.mark.parametrize("key,value,method", [("bos_id", 3, "get_bos_id"), ("eos_ids", [3], "get_eos_ids")])
def test_edited_bos_or_eos_in_the_manifest_is_refused(artifact_copy, key, value, method):
    m = json.loads((artifact_copy / C.MANIFEST_FILE).read_text())
    original = m["model"][key]
    m["model"][key] = value
    (artifact_copy / C.MANIFEST_FILE).write_text(json.dumps(m))
    code, _, stderr = _run([artifact_copy, "--prompt", "x"])
    line = _error_line(stderr)
    assert code == 2 and f"'{method}' returns {original}" in line and f"says {value}" in line


def test_engine_config_maps_the_matrix_product_flags():
    """--rows-kernel turns the few-rows kernel on (off by default), --row-invariant takes precedence over it, and
    neither changes anything on CPU."""
    from mg.runtime.cli import engine_config

    def config(device, row_invariant, rows_kernel):
        return engine_config(device, False, None, "adaptive", None, False, None, None, False, row_invariant,
                             rows_kernel)

    assert config("cuda", False, True).rows_mm and not config("cuda", False, False).rows_mm
    both = config("cuda", True, True)
    assert both.row_invariant_mm and not both.rows_mm
    assert not config("cpu", False, True).rows_mm
