"""ServeConfig: everything `blockdraft serve` is started with, typed and checked once. The CLI (cli/serve.py) maps
its flags onto it field by field (each field is the flag of the same name), and code that starts a server as a
process (the soak test, the serving benchmark) turns it back into those flags with `argv`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..decode.spec import ALIASES, METHODS, DecodeSpec


@dataclass(frozen=True)
class ServeConfig:
    """The model (target, draft, dtype, weights), how to decode (method .. recalibrate, batch_policy, draft_max_batch,
    max_step_tokens: the engine's DecodeSpec and its batch limits), where to listen (host, port, api_key) and the
    request limits (max_batch sequences decoded together, max_queue waiting beyond them, max_tokens_cap,
    max_prompt_tokens (0: only the target's context bounds prompts), max_body_bytes, body_timeout seconds to receive
    a body). threads: torch's intra-op threads (None: torch's choice); debug_step_delay: seconds slept per engine
    step (a testing aid)."""

    target: str | None = None
    draft: str | None = None
    dtype: str = "bf16"
    weights: str = "auto"
    method: str = "dflash"
    block_size: int | None = None
    denoise_steps: int = 1
    tree_budget: int | None = None
    draft_weights: str = "auto"
    recalibrate: bool = False
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_batch: int = 8
    batch_policy: str = "measured"
    draft_max_batch: int = 0
    max_queue: int = 32
    max_tokens_cap: int = 512
    max_prompt_tokens: int = 2048
    max_step_tokens: int | None = None
    max_body_bytes: int = 1 << 20
    body_timeout: float = 30.0
    threads: int | None = None
    log_level: str = "warning"
    debug_step_delay: float = 0.0

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_queue < 0 or self.max_tokens_cap < 1 or self.max_body_bytes < 1:
            raise ValueError("--max-batch and --max-tokens-cap must be >= 1, --max-queue >= 0, --max-body-bytes >= 1")
        if self.max_prompt_tokens < 0:
            raise ValueError("--max-prompt-tokens must be >= 0 (0: only the target's context bounds prompts)")
        if not self.body_timeout > 0:
            raise ValueError("--body-timeout must be > 0 seconds")
        self.decode_spec()  # an unknown method or a bad block size is refused before any model loads

    def decode_spec(self) -> DecodeSpec:
        """The engine's DecodeSpec; a --draft that names a method drafting without a draft model (`pld`,
        `lookup`, `lookup-tree`) selects that method whatever --method says."""
        spec = DecodeSpec(method=self.method, block_size=self.block_size, denoise_steps=self.denoise_steps,
                          tree_budget=self.tree_budget, draft_weights=self.draft_weights,
                          batch_policy=self.batch_policy, recalibrate=self.recalibrate)
        named = ALIASES.get((self.draft or "").lower(), (self.draft or "").lower())
        if named in METHODS and METHODS[named].draft is None and METHODS[named].drafts:
            spec = dataclasses.replace(spec, method=named)
        return spec

    def argv(self) -> list[str]:
        """The `blockdraft serve` flags that start a server with this config: each field that differs from its
        default. The API key is left out (a command line is visible to every user of the machine): a server started
        from these flags reads it from $BLOCKDRAFT_API_KEY."""
        out: list[str] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "api_key" or value == f.default:
                continue
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                out += [flag] if value else []
            elif value is not None:
                out += [flag, str(value)]
        return out
