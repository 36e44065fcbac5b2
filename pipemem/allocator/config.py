"""The caching allocator's settings: `PYTORCH_CUDA_ALLOC_CONF` parsed the way PyTorch parses it.

Rules (c10/cuda/CUDAAllocatorConfig.cpp in torch 2.1-2.8; c10/core/AllocatorConfig.cpp
`AcceleratorAllocatorConfig` from 2.9 on, same grammar and bounds):

* The string is split into tokens at `,` `:` `[` `]`; spaces are dropped (`lexArgs`). Each
  option is `key:value`, options separated by `,`. A key PyTorch does not know is an error
  ("Unrecognized CachingAllocator option").
* `max_split_size_mb:N`: N must be > 20 (kLargeBuffer in MiB); blocks of N MiB or more are
  "oversize": never split, and not handed to a request below N MiB.
* `max_non_split_rounding_mb:N` (2.5+): how much larger than a request >= max_split_size an
  oversize cached block may be and still serve it (default kLargeBuffer, 20 MiB); N > 20.
* `roundup_power2_divisions:D` (D a power of two) for every size, or
  `roundup_power2_divisions:[256:1,512:2,>:8]`: per power-of-two interval of MiB (1 MiB .. 32 GiB,
  16 intervals); the first listed value also fills the intervals below it, `>` fills the rest.
  0 or 1 means no power-of-two rounding.
* `garbage_collection_threshold:F`, 0 < F < 1: only acts with a per-process memory fraction.
* `expandable_segments:True|False`.
* `backend:native|cudaMallocAsync`; `release_lock_on_cudamalloc`, the pinned-memory options and
  `graph_capture_record_stream_reuse` do not change device memory and are accepted as-is.
* `per_process_memory_fraction:F` (2.9+), 0 <= F <= 1: the allocator's own cap as a fraction of
  the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import UserError

MiB = 1 << 20
K_LARGE_BUFFER = 20 * MiB
NUM_INTERVALS = 16  # kRoundUpPowerOfTwoIntervals: 1 MiB .. 32 GiB
SIZE_MAX = (1 << 64) - 1  # std::numeric_limits<size_t>::max(): max_split_size unset

_BOOL_KEYS = (
    "expandable_segments",
    "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register",
    "pinned_use_background_threads",
    "graph_capture_record_stream_reuse",
)
_INT_KEYS = ("pinned_num_register_threads", "pinned_reserve_segment_size_mb")
KNOWN_KEYS = (
    (
        "backend",
        "max_split_size_mb",
        "max_non_split_rounding_mb",
        "roundup_power2_divisions",
        "garbage_collection_threshold",
        "per_process_memory_fraction",
    )
    + _BOOL_KEYS
    + _INT_KEYS
)


def _flag(key: str) -> str:
    return f"--alloc-conf {key}"


@dataclass(frozen=True)
class AllocatorConfig:
    """The settings that change what the caching allocator reserves."""

    max_split_size: int = SIZE_MAX
    max_non_split_rounding_size: int = K_LARGE_BUFFER
    roundup_power2_divisions: tuple = (0,) * NUM_INTERVALS
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    per_process_memory_fraction: float | None = None
    text: str = field(default="", compare=False)

    # -- parsing -------------------------------------------------------------------------

    @classmethod
    def parse(cls, text: str | None) -> "AllocatorConfig":
        """Parse a PYTORCH_CUDA_ALLOC_CONF string ("" or None: the defaults)."""
        if not text or not text.strip():
            return cls()
        tokens = _lex(text)
        values: dict = {}
        i = 0
        while i < len(tokens):
            key = tokens[i]
            if key not in KNOWN_KEYS:
                raise UserError(
                    f"--alloc-conf: unknown key {key!r}; PyTorch's allocator knows {', '.join(KNOWN_KEYS)}"
                )
            i = _expect(tokens, i + 1, ":", key)
            if key == "roundup_power2_divisions":
                values[key], i = _parse_divisions(tokens, i + 1)
            else:
                if i + 1 >= len(tokens) or tokens[i + 1] in ",:[]":
                    raise UserError(f"{_flag(key)}: expected a value after '{key}:'")
                values[key] = _parse_scalar(key, tokens[i + 1])
                i += 1
            if i + 1 < len(tokens):
                i = _expect(tokens, i + 1, ",", key)
            i += 1
        return cls._from_values(values, text)

    @classmethod
    def _from_values(cls, values: dict, text: str) -> "AllocatorConfig":
        if values.get("backend", "native") != "native":
            raise UserError(
                "--alloc-conf backend:cudaMallocAsync: the CUDA driver's own pool is not "
                "modelled; use backend:native (the default)"
            )
        kw = {"text": text}
        if "max_split_size_mb" in values:
            kw["max_split_size"] = values["max_split_size_mb"] * MiB
        if "max_non_split_rounding_mb" in values:
            kw["max_non_split_rounding_size"] = values["max_non_split_rounding_mb"] * MiB
        for k in (
            "roundup_power2_divisions",
            "garbage_collection_threshold",
            "expandable_segments",
            "per_process_memory_fraction",
        ):
            if k in values:
                kw[k] = values[k]
        return cls(**kw)

    @classmethod
    def from_snapshot_settings(cls, settings: dict | None) -> "AllocatorConfig":
        """The settings a snapshot recorded (`allocator_settings` of `_dump_snapshot`; absent
        before torch 2.2: the defaults)."""
        if not settings:
            return cls()
        text = settings.get("PYTORCH_CUDA_ALLOC_CONF") or ""
        try:  # what the text sets that the settings do not record (max_non_split_rounding_mb)
            base = cls.parse(text) if isinstance(text, str) else cls()
        except UserError:
            base = cls()
        kw = {
            "text": text,
            "max_non_split_rounding_size": base.max_non_split_rounding_size,
            "per_process_memory_fraction": base.per_process_memory_fraction,
            "max_split_size": base.max_split_size,
            "roundup_power2_divisions": base.roundup_power2_divisions,
            "garbage_collection_threshold": base.garbage_collection_threshold,
        }
        mss = settings.get("max_split_size")
        if isinstance(mss, int) and 0 < mss < SIZE_MAX:
            kw["max_split_size"] = mss
        nsr = settings.get("max_non_split_rounding_size")
        if isinstance(nsr, int) and nsr > 0:
            kw["max_non_split_rounding_size"] = nsr
        gc = settings.get("garbage_collection_threshold")
        if isinstance(gc, (int, float)) and 0 < gc < 1:
            kw["garbage_collection_threshold"] = float(gc)
        kw["expandable_segments"] = bool(settings.get("expandable_segments", False))
        div = settings.get("roundup_power2_divisions")
        if isinstance(div, dict) and len(div) == NUM_INTERVALS:
            # keys are the interval starts in MiB ("1", "2", ... "32768")
            try:
                by_mb = sorted((int(k), int(v)) for k, v in div.items())
                kw["roundup_power2_divisions"] = tuple(max(v, 0) for _, v in by_mb)
            except (TypeError, ValueError):
                pass
        elif isinstance(div, int) and div > 1:
            kw["roundup_power2_divisions"] = (div,) * NUM_INTERVALS
        return cls(**kw)

    # -- the size rules ------------------------------------------------------------------

    def divisions_for(self, size: int) -> int:
        """roundup_power2_divisions(size): the setting of the power-of-two interval (in MiB,
        1 MiB .. 32 GiB, clamped at both ends) that holds `size`."""
        index = min(max(size.bit_length() - 1 - 20, 0), NUM_INTERVALS - 1)
        return self.roundup_power2_divisions[index]

    def describe(self) -> str:
        parts = []
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.max_split_size != SIZE_MAX:
            parts.append(f"max_split_size_mb:{self.max_split_size // MiB}")
        if self.max_non_split_rounding_size != K_LARGE_BUFFER:
            parts.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding_size // MiB}")
        if any(d > 1 for d in self.roundup_power2_divisions):
            ds = set(self.roundup_power2_divisions)
            if len(ds) == 1:
                parts.append(f"roundup_power2_divisions:{self.roundup_power2_divisions[0]}")
            else:
                items = ",".join(f"{1 << i}:{d}" for i, d in enumerate(self.roundup_power2_divisions))
                parts.append(f"roundup_power2_divisions:[{items}]")
        if self.garbage_collection_threshold:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold:g}")
        if self.per_process_memory_fraction is not None:
            parts.append(f"per_process_memory_fraction:{self.per_process_memory_fraction:g}")
        return ",".join(parts) or "defaults"


def _lex(text: str) -> list[str]:
    """lexArgs: `,` `:` `[` `]` are tokens of their own; spaces are dropped."""
    tokens, buf = [], []
    for ch in text:
        if ch in ",:[]":
            if buf:
                tokens.append("".join(buf))
                buf = []
            tokens.append(ch)
        elif ch != " ":
            buf.append(ch)
    if buf:
        tokens.append("".join(buf))
    return tokens


def _expect(tokens: list[str], i: int, ch: str, key: str) -> int:
    if i >= len(tokens) or tokens[i] != ch:
        got = tokens[i] if i < len(tokens) else "the end"
        raise UserError(
            f"{_flag(key)}: expected '{ch}' but found {got!r} (the syntax is key:value,key:value)"
        )
    return i


def _int(key: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise UserError(f"{_flag(key)}: {text!r} is not a whole number") from None


def _parse_scalar(key: str, text: str):
    if key in _BOOL_KEYS:
        if text not in ("True", "False"):
            raise UserError(f"{_flag(key)}: expected True or False, got {text!r}")
        return text == "True"
    if key == "backend":
        if text not in ("native", "cudaMallocAsync"):
            raise UserError(f"{_flag(key)}: expected native or cudaMallocAsync, got {text!r}")
        return text
    if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
        v = _int(key, text)
        if v <= K_LARGE_BUFFER // MiB:
            raise UserError(f"{_flag(key)}: {v} is too small, must be > {K_LARGE_BUFFER // MiB}")
        return min(v, SIZE_MAX // MiB)
    if key in ("garbage_collection_threshold", "per_process_memory_fraction"):
        try:
            v = float(text)
        except ValueError:
            raise UserError(f"{_flag(key)}: {text!r} is not a number") from None
        if key == "garbage_collection_threshold" and not 0.0 < v < 1.0:
            raise UserError(f"{_flag(key)}: {text} is out of range; set it between 0.0 and 1.0 (exclusive)")
        if key == "per_process_memory_fraction" and not (0.0 <= v <= 1.0 and math.isfinite(v)):
            raise UserError(f"{_flag(key)}: {text} is out of range; set it between 0.0 and 1.0")
        return v
    v = _int(key, text)  # the pinned-memory integers
    if v < 0:
        raise UserError(f"{_flag(key)}: {v} must not be negative")
    return v


def _is_pow2(v: int) -> bool:
    return v > 0 and (v & (v - 1)) == 0


def _parse_divisions(tokens: list[str], i: int) -> tuple[tuple, int]:
    """parseRoundUpPower2Divisions: a single power of two, or a bracketed list of
    `interval_MiB:divisions` with `>` for every interval after the last one named."""
    key = "roundup_power2_divisions"
    if i >= len(tokens):
        raise UserError(f"{_flag(key)}: expected a value")
    if tokens[i] != "[":
        v = _int(key, tokens[i])
        if not _is_pow2(v):
            raise UserError(f"{_flag(key)}: {v} must be a power of 2")
        return (v,) * NUM_INTERVALS, i
    out = [0] * NUM_INTERVALS
    first, last_index = True, 0
    i += 1
    while i < len(tokens) and tokens[i] != "]":
        interval = tokens[i]
        i = _expect(tokens, i + 1, ":", key)
        if i + 1 >= len(tokens):
            raise UserError(f"{_flag(key)}: expected a value after {interval!r}:")
        i += 1
        div = _int(key, tokens[i])
        if div != 0 and not _is_pow2(div):
            raise UserError(f"{_flag(key)}: divisions {div} must be a power of 2 or 0")
        if interval == ">":
            for j in range(last_index, NUM_INTERVALS):
                out[j] = div
        else:
            mb = _int(key, interval)
            if not _is_pow2(mb):
                raise UserError(f"{_flag(key)}: interval {mb} (MiB) must be a power of 2")
            index = min(mb.bit_length() - 1, NUM_INTERVALS - 1)
            if first:
                for j in range(index):
                    out[j] = div
                first = False
            out[index] = div
            last_index = index
        if i + 1 < len(tokens) and tokens[i + 1] != "]":
            i = _expect(tokens, i + 1, ",", key)
        i += 1
    if i >= len(tokens):
        raise UserError(f"{_flag(key)}: missing ']'")
    return tuple(out), i
