"""The coordinator's settings, in one table for both ways it is run.

``specdec coordinator`` takes them as flags (``--num-speculative-tokens 3``); the Ray Serve
application (``serve_app.build_app``, what deploy/ runs) takes the same names as the args of its
``serveConfigV2`` entry (``num_speculative_tokens: 3``); either falls back on the environment
(``SPECDEC_NUM_SPECULATIVE_TOKENS=3``, the ConfigMap deploy/ mounts). The defaults are
:class:`~coordinator.core.CoordinatorConfig`'s, so they live in one place too.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from coordinator.config import MAX_CONTENTION, METHODS, PIPELINING, CoordinatorConfig
from specdec.loop.adaptive_k import StepCost
from specdec.loop.reproducible import SEEDED_SAMPLING


def _boolean(value: Any) -> bool:
    """A YAML boolean, or its spelling as a string (``bool("false")`` would be True)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "yes", "on", "1"):
        return True
    if text in ("false", "no", "off", "0"):
        return False
    raise ValueError(f"must be true or false, got {value!r}")


def _method(value: Any) -> str:
    if str(value) not in METHODS:
        raise ValueError(f"must be one of {', '.join(METHODS)}, got {value!r}")
    return str(value)


def _seeded_sampling(value: Any) -> str:
    if str(value) not in SEEDED_SAMPLING:
        raise ValueError(f"must be one of {', '.join(SEEDED_SAMPLING)}, got {value!r}")
    return str(value)


def _pipelining(value: Any) -> str:
    """auto / on / off, or a YAML boolean (on / off)."""
    if str(value) in PIPELINING:
        return str(value)
    try:
        return "on" if _boolean(value) else "off"
    except ValueError:
        raise ValueError(f"must be one of {', '.join(PIPELINING)}, got {value!r}") from None


def _contention(value: Any) -> float | None:
    """auto (None: from the replicas' placement) or a number in [0, MAX_CONTENTION]."""
    if str(value).strip().lower() == "auto":
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"must be auto or a number in [0, {MAX_CONTENTION:g}], got {value!r}") from None
    if not 0.0 <= number <= MAX_CONTENTION:
        raise ValueError(f"must be auto or a number in [0, {MAX_CONTENTION:g}], got {value!r}")
    return number


def _step_cost(value: Any) -> StepCost:
    return StepCost.parse(str(value))


@dataclass(frozen=True)
class Setting:
    name: str  # the Serve arg; the flag is --name with dashes
    parse: Callable[[Any], Any]
    help: str
    field: str | None = None  # the CoordinatorConfig field it sets (None: a setting of the front)
    invert: bool = False  # a flag that turns the field off (--fixed-k sets default_adaptive False)
    switch: bool = False  # a flag that turns the field on (--replayable-schedule)
    bare: Any = None  # the value of the flag given without one (--pipeline-drafts: on); None: it needs one

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


SETTINGS = (
    Setting("redis", str, "Redis URL for the replica registry and the session log (default: REDIS_URL)", "redis_url"),
    Setting("target", str, "a static target address HOST:PORT (besides the registry)", "target_address"),
    Setting("draft", str, "a static draft address HOST:PORT (besides the registry)", "draft_address"),
    Setting("tokenizer", str, "tokenizer model spec (default: the target's model)", "tokenizer"),
    Setting("num_speculative_tokens", int, "default k: the tokens a draft block proposes", "default_k"),
    Setting(
        "fixed_k",
        _boolean,
        "requests that do not say propose k tokens every step (default for draft models: adaptive, "
        "target-only steps while the request's blocks do not pay; see specdec/loop/adaptive_k.py)",
        "default_adaptive",
        invert=True,
    ),
    Setting(
        "step_cost",
        _step_cost,
        "the adaptive policy's cost of a step proposing k tokens, 1 + FIXED + PER_TOKEN * k target-only steps "
        "(FIXED,PER_TOKEN; measured on a 2-core CPU, see docs/performance.md)",
        "step_cost",
    ),
    Setting(
        "replayable_schedule",
        _boolean,
        "adaptive requests that do not sample invariantly choose k from their own past only, not from the "
        "load, seeded or not (default: only seeded sampled ones under --seeded-sampling replayable; "
        "otherwise load-aware, docs/goodput.md)",
        "replayable_schedule",
        switch=True,
    ),
    Setting(
        "seeded_sampling",
        _seeded_sampling,
        "how a request that sends a seed and samples (temperature > 0) gets the same tokens every time "
        "when it does not say: 'invariant' sampling (its tokens a function of the seed alone, whatever the "
        "load, k, draft or replica; some acceptance lost) or rejection sampling on a 'replayable' schedule "
        "(k from its own past only: speculating under load where it does not pay). docs/exactness.md, "
        "'What a seed fixes'",
        "seeded_sampling",
    ),
    Setting(
        "invariant_sampling",
        _boolean,
        "every request that does not say samples invariantly, seeded or not (default: only seeded sampled "
        "ones, see --seeded-sampling; docs/exactness.md, 'Invariant sampling')",
        "invariant_sampling",
        switch=True,
    ),
    Setting(
        "no_prefix_routing",
        _boolean,
        "start every session on the least-loaded replica (default: on the replica this coordinator last "
        "sent the prompt's prefix to, which may still hold it in its prefix cache, unless that one is "
        "busier by more than a few sessions; docs/batching.md, 'Prefix caching')",
        "prefix_routing",
        invert=True,
    ),
    Setting(
        "pipeline_drafts",
        _pipelining,
        "whether requests that do not say draft their next block while the target verifies this one, for the "
        "outcomes of the verdict the draft can guess (a step landing on one makes no draft call; the same tokens "
        "either way): 'auto' where the session's draft and target compute apart (other nodes, or GPUs of their "
        "own; on one CPU the draft slowed the target by what it saved), 'on' (the flag alone), or 'off'; "
        "docs/pipelining.md",
        "pipeline_drafts",
        bare="on",
    ),
    Setting(
        "contention",
        _contention,
        "what the load-aware policy assumes of the machine at a load it has not measured yet: 'auto' (default) "
        f"{MAX_CONTENTION:g} where a session's draft and target share their hardware (their passes take turns "
        "and their threads contend for the cores: speculation loses under load), 0 where they compute apart "
        "(the replicas' profiles hold), or a number in between; measured loads refit it (docs/goodput.md, "
        "'Bursts')",
        "contention",
    ),
    Setting(
        "report_unscoped_cached_tokens",
        _boolean,
        "tell requests with neither an API key nor a cache_salt how many prompt tokens they found in the prefix "
        "cache (usage.prompt_tokens_details.cached_tokens, stats.cached_prompt_tokens), which they all share: "
        "a client could then confirm what another sent. Default: 0 for them; a key or salt always gets its own "
        "(docs/http-api.md, 'What is shared')",
        "report_unscoped_cached_tokens",
        switch=True,
    ),
    Setting("max_speculative_tokens", int, "largest k a request may ask for", "max_k"),
    Setting("default_max_new_tokens", int, "max_new_tokens of a request that does not say", "default_max_new_tokens"),
    Setting("max_new_tokens_limit", int, "largest max_new_tokens a request may ask for", "max_new_tokens_limit"),
    Setting("max_concurrent_requests", int, "requests in flight per coordinator replica", "max_concurrent_requests"),
    Setting("max_resume_readers", int, "resumed streams reading the session log at once", "max_resume_readers"),
    Setting("draft_timeout", float, "seconds before a draft call is abandoned", "draft_timeout_s"),
    Setting("default_method", _method, "speculation method of a request that does not say", "default_method"),
    Setting("output_ttl", float, "seconds a request's output stays resumable after its last token", "output_ttl_s"),
    Setting(
        "max_output_bytes",
        int,
        "bytes of output the session log keeps per request (past it the request ends RESOURCE_EXHAUSTED)",
        "max_output_bytes",
    ),
    Setting(
        "max_output_bytes_per_key",
        int,
        "bytes of the session log one API key's requests may hold: what each may write, reserved while it runs "
        "(from its max_new_tokens and logprobs), then its output until it expires; past it the key's new requests "
        "are RESOURCE_EXHAUSTED, other keys' unaffected",
        "max_output_bytes_per_key",
    ),
    Setting("metrics_port", int, "serve Prometheus /metrics on this port (0 = off)"),
)
BY_NAME = {s.name: s for s in SETTINGS}
_DEFAULTS = {f.name: f.default for f in fields(CoordinatorConfig)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every setting as a flag (unset flags keep the default)."""
    for s in SETTINGS:
        if s.invert or s.switch:
            parser.add_argument(s.flag, action="store_true", default=None, help=s.help)
            continue
        default = _DEFAULTS.get(s.field) if s.field else 0
        shown = f" (default: {default})" if default not in (None, "") and "default:" not in s.help else ""
        bare = {} if s.bare is None else {"nargs": "?", "const": s.bare}
        parser.add_argument(s.flag, type=_argparse_type(s), default=None, help=s.help + shown, **bare)


def _argparse_type(setting: Setting) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return setting.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = setting.name  # what argparse names in "invalid <name> value"
    return parse


def parse_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """Setting name -> value, parsed; unknown names and bad values are a ValueError naming them.
    ``None`` means unset."""
    unknown = sorted(set(values) - set(BY_NAME))
    if unknown:
        raise ValueError(f"unknown coordinator settings {unknown}; known: {sorted(BY_NAME)}")
    parsed = {}
    for name, value in values.items():
        if value is None:
            continue
        try:
            parsed[name] = BY_NAME[name].parse(value)
        except ValueError as exc:
            raise ValueError(f"coordinator setting {name}: {exc}") from None
    return parsed


ENV_PREFIX = "SPECDEC_"  # SPECDEC_NUM_SPECULATIVE_TOKENS=3: a setting from the environment


def env_name(setting: Setting) -> str:
    return ENV_PREFIX + setting.name.upper()


def values_from_env(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The settings the environment gives (``SPECDEC_<NAME>``, what a Kubernetes ConfigMap sets
    with envFrom), parsed; a bad value is a ValueError naming the variable."""
    env = os.environ if env is None else env
    out = {}
    for s in SETTINGS:
        if env.get(env_name(s), "") == "":
            continue
        try:
            out[s.name] = s.parse(env[env_name(s)])
        except ValueError as exc:
            raise ValueError(f"{env_name(s)}: {exc}") from None
    return out


def config_from(values: Mapping[str, Any]) -> CoordinatorConfig:
    """The request path's config from parsed settings over those of the environment
    (``SPECDEC_<NAME>``; REDIS_URL when ``redis`` is unset): flags and Serve args win."""
    kwargs: dict[str, Any] = {}
    for name, value in {**values_from_env(), **values}.items():
        s = BY_NAME[name]
        if s.field is not None:
            kwargs[s.field] = (not value) if s.invert else value
    if not kwargs.get("redis_url"):
        kwargs["redis_url"] = os.environ.get("REDIS_URL") or None
    return CoordinatorConfig(**kwargs)


def values_from_namespace(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given on a command line (flags left unset are absent)."""
    return {s.name: getattr(args, s.name) for s in SETTINGS if getattr(args, s.name, None) is not None}
