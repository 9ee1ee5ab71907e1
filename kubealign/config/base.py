"""The base of every config section: frozen, unknown keys refused, every number finite."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

DType = Literal["fp32", "bf16", "fp16"]


class Section(BaseModel):
    # allow_inf_nan=False: every number of every section must be finite. A learning rate of .inf or a
    # coefficient of .nan passes gt=0 / ge=0 (inf > 0; nan fails no comparison pydantic makes) and trains a
    # NaN model with exit 0; refused here, with the field named.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
