"""Reading requests (`--prompt`, JSONL) and writing results (JSONL), for `mg-run`.

A JSONL line is `{"id": str, "prompt": str}` (text: the tokenizer and BOS rule
apply) or `{"id": str, "tokens": [int, ...]}` (ids verbatim), with optional
`max_new_tokens`, `temperature`, `top_k`, `top_p`, `seed`, `ignore_eos`. A bad line becomes
an error result for that line alone. Knows nothing about programs or caches.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Union

from .sampling import SamplingParams
from .scheduler import Request
from .tokenizer import TextCodec

EMPTY_PROMPT = ("the prompt is empty; give at least one character (to generate from BOS alone, give "
                "'tokens': [BOS id])")
OPTIONAL_KEYS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "ignore_eos")
ALLOWED_KEYS = ("id", "prompt", "tokens") + OPTIONAL_KEYS


@dataclass(frozen=True)
class Defaults:
    max_new_tokens: int
    sampling: SamplingParams


@dataclass(frozen=True)
class BadRequest:
    id: str
    error: str


def _int_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_request(obj, where: str, defaults: Defaults, codec: Optional[TextCodec]) -> Union[Request, BadRequest]:
    if not isinstance(obj, dict):
        return BadRequest(where, f"{where}: expected a JSON object, found {type(obj).__name__}")
    rid = obj.get("id", where)
    if not isinstance(rid, str):
        return BadRequest(where, f"{where}: 'id' must be a string; found {rid!r}")
    unknown = sorted(set(obj) - set(ALLOWED_KEYS))
    if unknown:
        return BadRequest(rid, f"{where}: unknown key '{unknown[0]}'; allowed: {', '.join(ALLOWED_KEYS)}")
    if ("prompt" in obj) == ("tokens" in obj):
        return BadRequest(rid, f"{where}: give exactly one of 'prompt' (text) or 'tokens' (ids)")
    if "tokens" in obj:
        if not _int_list(obj["tokens"]):
            return BadRequest(rid, f"{where}: 'tokens' must be a list of integers")
        prompt = list(obj["tokens"])
    else:
        if not isinstance(obj["prompt"], str):
            return BadRequest(rid, f"{where}: 'prompt' must be a string")
        if codec is None:
            return BadRequest(rid, f"{where}: a text 'prompt' needs a tokenizer.json in the artifact; "
                                   f"give 'tokens' instead")
        if not obj["prompt"]:
            return BadRequest(rid, f"{where}: {EMPTY_PROMPT}")
        prompt = codec.encode(obj["prompt"])
    s = defaults.sampling
    max_new = obj.get("max_new_tokens", defaults.max_new_tokens)
    if not isinstance(max_new, int) or isinstance(max_new, bool):
        return BadRequest(rid, f"{where}: 'max_new_tokens' must be an integer; found {max_new!r}")
    for key in ("temperature", "top_p"):
        if key in obj and not _number(obj[key]):
            return BadRequest(rid, f"{where}: '{key}' must be a number; found {obj[key]!r}")
    for key in ("top_k", "seed"):
        if key in obj and (not isinstance(obj[key], int) or isinstance(obj[key], bool)):
            return BadRequest(rid, f"{where}: '{key}' must be an integer; found {obj[key]!r}")
    ignore_eos = obj.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        return BadRequest(rid, f"{where}: 'ignore_eos' must be true or false; found {ignore_eos!r}")
    params = SamplingParams(temperature=float(obj.get("temperature", s.temperature)),
                            top_k=obj.get("top_k", s.top_k), top_p=float(obj.get("top_p", s.top_p)),
                            seed=obj.get("seed", s.seed))
    try:
        params.validate()
    except ValueError as e:
        return BadRequest(rid, f"{where}: {e}")
    return Request(rid, tuple(prompt), max_new, params, ignore_eos=ignore_eos)


def read_jsonl(path: Path, defaults: Defaults, codec: Optional[TextCodec]) -> list[Union[Request, BadRequest]]:
    with open(path, encoding="utf-8") as f:
        return read_lines(f, str(path), defaults, codec)


def read_lines(lines: Iterable[str], source: str, defaults: Defaults,
               codec: Optional[TextCodec]) -> list[Union[Request, BadRequest]]:
    """Parse JSONL request lines; a bad line becomes a BadRequest of its own, named '<source>:<line>'."""
    out: list[Union[Request, BadRequest]] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            out.append(BadRequest(where, f"{where}: not valid JSON ({e.msg})"))
            continue
        out.append(parse_request(obj, where, defaults, codec))
    ids = [r.id for r in out]
    dup = next((i for i in ids if ids.count(i) > 1), None)
    if dup is not None:
        raise ValueError(f"{source}: request id {dup!r} appears more than once; ids must be unique")
    return out


def result_record(rid: str, tokens, finish_reason, error, codec: Optional[TextCodec],
                  seed: Optional[int] = None) -> dict:
    """One output line; `seed` (sampled requests) is reported so that the line can be reproduced."""
    if error is not None:
        return {"id": rid, "error": error}
    rec = {"id": rid, "tokens": list(tokens)}
    if codec is not None:
        rec["text"] = codec.decode(list(tokens))
    rec["finish_reason"] = finish_reason
    if seed is not None:
        rec["seed"] = seed
    return rec
