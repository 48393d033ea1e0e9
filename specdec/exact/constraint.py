"""A request's structured-output constraint as data, and the transform it adds to the pipeline.

What the constraint admits at a position comes from a matcher (specdec.modeling.grammar); here is
only what every side must agree on: the constraint's validated description, and how an allowed
set enters the law -- every other token's logit is -inf, after the pipeline's logits steps
(bias, min_tokens, penalties) and before temperature and truncation (docs/structured-output.md).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

from specdec.errors import InvalidArgumentError

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 64 * 1024  # a schema / regex / grammar text past this is refused
MAX_CHOICES = 256


@dataclass(frozen=True)
class Constraint:
    """What a request constrains its output to. ``spec``: the JSON schema text (json_schema), a
    regex (regex), a JSON list of strings (choice), a Lark or GBNF grammar (grammar); empty for
    json_object (any JSON object)."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgumentError("constraint", f"kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if not isinstance(self.spec, str):
            raise InvalidArgumentError("constraint", f"the {self.kind} must be text")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise InvalidArgumentError(
                "constraint", f"the {self.kind} is {len(self.spec)} characters; at most {MAX_SPEC_CHARS}"
            )
        if self.kind != "json_object" and not self.spec.strip():
            raise InvalidArgumentError("constraint", f"a {self.kind} constraint needs its {self.kind}")
        if self.kind == "choice":
            choices_of(self.spec)


def choices_of(spec: str) -> list[str]:
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError as error:
        raise InvalidArgumentError("constraint", f"choice: not a JSON list of strings ({error.msg})") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidArgumentError("constraint", "choice: a non-empty JSON list of non-empty strings")
    if len(choices) > MAX_CHOICES:
        raise InvalidArgumentError("constraint", f"choice: {len(choices)} choices; at most {MAX_CHOICES}")
    return choices


def constrained(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``logits`` ([..., V]) with every token outside ``allowed`` ([..., V] bool, broadcast) at
    -inf. A row that allows nothing is the caller's bug (a matcher always allows EOS at least)."""
    return logits.masked_fill(~allowed, -math.inf)
