"""Which runner an engine is, and how its model pools (vLLM's --runner / --pooler-config).

* `--runner generate`: generation routes; `LLM.embed()` still works offline on a model
  with an LM head (the engine takes both kinds of request in one batch).
* `--runner pooling` (`--task embed`): an embedding engine; generation requests are
  refused (there may be no LM head), the server serves /v1/embeddings.
* `--runner auto` (the default): pooling for a checkpoint without an LM head (an HF
  `*Model` architecture such as Qwen3-Embedding's `Qwen3Model`) or with
  sentence-transformers files (`modules.json` naming a Pooling module), else generate.

The pooler: the checkpoint's sentence-transformers files (the Pooling module's
`config.json`: `pooling_mode_lasttoken` / `_mean_tokens` / `_cls_token`; a Normalize
module -> L2-normalised), then `--pooler-config` field by field on top; without either,
last-token pooling, normalised (vLLM's default for decoder embeddings).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields

from tokenmill.pooling.params import POOLING_TYPES

RUNNERS = ("auto", "generate", "pooling")
# vLLM's older --task names for the same choice.
TASK_RUNNERS = {"auto": "auto", "generate": "generate", "embed": "pooling"}

_ST_MODULE = "sentence_transformers.models."
# The Pooling module's config keys tokenmill runs, and the type each means.
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
             "pooling_mode_cls_token": "CLS"}
# Modes sentence-transformers has that tokenmill does not run: refused by name.
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "LAST"
    normalize: bool = True

    def describe(self) -> str:
        return f"{self.pooling_type} pooling{', normalised' if self.normalize else ''}"

    @classmethod
    def override(cls, base: "PoolerConfig", value) -> "PoolerConfig":
        """`base` with the fields of `value` (--pooler-config: a dict or its JSON; None:
        `base` as is). ValueError naming the bad field."""
        if value is None:
            return base
        if isinstance(value, PoolerConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"pooler_config: not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError(f"pooler_config must be a JSON object, got "
                             f"{type(value).__name__}")
        known = {f.name for f in fields(cls)}
        for k in value:
            if k not in known:
                raise ValueError(f"pooler_config: unknown field {k!r}; known: "
                                 f"{', '.join(sorted(known))}")
        kind = value.get("pooling_type", base.pooling_type)
        if not isinstance(kind, str) or kind.upper() not in POOLING_TYPES:
            raise ValueError(f"pooler_config.pooling_type must be one of "
                             f"{', '.join(POOLING_TYPES)}, got {kind!r}")
        norm = value.get("normalize", base.normalize)
        if not isinstance(norm, bool):
            raise ValueError(f"pooler_config.normalize must be true or false, got {norm!r}")
        return cls(kind.upper(), norm)


def _st_modules(model_dir: str) -> list[dict] | None:
    path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        modules = json.load(f)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{path}: expected a list of module objects")
    return modules


def read_sentence_transformers(model_dir: str) -> PoolerConfig | None:
    """The pooler a checkpoint's sentence-transformers files describe, or None when it
    has none (no modules.json, or one without a Pooling module). A module or pooling
    mode tokenmill cannot run (Dense projections, max / weighted-mean pooling) is a
    ValueError naming it: serving such a model without it would give other vectors."""
    modules = _st_modules(model_dir)
    if modules is None:
        return None
    kinds = [str(m.get("type", "")) for m in modules]
    pooling = [m for m, t in zip(modules, kinds) if t == _ST_MODULE + "Pooling"]
    if not pooling:
        return None
    for t in kinds:
        if t.startswith(_ST_MODULE) and t[len(_ST_MODULE):] not in (
                "Transformer", "Pooling", "Normalize"):
            raise ValueError(f"{model_dir}/modules.json: module {t} is not supported "
                             f"(tokenmill runs Transformer -> Pooling -> Normalize)")
    cfg_path = os.path.join(model_dir, str(pooling[0].get("path", "")), "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"{model_dir}/modules.json names a Pooling module without its "
                         f"config ({cfg_path} is missing)")
    with open(cfg_path) as f:
        cfg = json.load(f)
    for mode in _ST_UNSUPPORTED:
        if cfg.get(mode):
            raise ValueError(f"{cfg_path}: {mode} is not supported (tokenmill pools "
                             f"last-token, mean or CLS)")
    chosen = [kind for key, kind in _ST_MODES.items() if cfg.get(key)]
    if len(chosen) != 1:
        raise ValueError(f"{cfg_path}: expected exactly one of {', '.join(_ST_MODES)} set, "
                         f"got {len(chosen)}")
    return PoolerConfig(chosen[0], _ST_MODULE + "Normalize" in kinds)


def has_lm_head(hf_config: dict) -> bool:
    """False for a checkpoint of HF's bare `*Model` classes (the decoder without its
    LM head: how embedding models such as Qwen3-Embedding are saved)."""
    archs = hf_config.get("architectures") or []
    return not (archs and all(a.endswith("Model") and "For" not in a for a in archs))


def resolve_pooling(runner: str, pooler_config, hf_config: dict,
                    model_dir: str) -> tuple[str, PoolerConfig]:
    """(the runner, "generate" or "pooling"; the model's pooler config) for --runner
    `runner` ("auto", "generate", "pooling"; or a --task name) and --pooler-config
    `pooler_config` (a dict, its JSON or None)."""
    runner = TASK_RUNNERS.get(runner, runner)
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)} (or task embed / "
                         f"generate), got {runner!r}")
    st = read_sentence_transformers(model_dir)
    headless = not has_lm_head(hf_config)
    if runner == "auto":
        runner = "pooling" if headless or st is not None else "generate"
    if runner == "generate" and headless:
        archs = hf_config.get("architectures")
        raise ValueError(f"runner generate: the checkpoint's architecture {archs} has no LM "
                         f"head, so it can only pool; serve it with --runner pooling")
    return runner, PoolerConfig.override(st or PoolerConfig(), pooler_config)
