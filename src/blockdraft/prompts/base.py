"""The prompt record shared by evaluation tasks and training prompt sources, and the user JSONL prompt format."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Prompt:
    """One prompt: `messages` is a chat (dicts with `role` and `content`) ending with a user turn; `extra_turns`
    are later user turns of a multi-turn conversation (MT-Bench turn 2), sent after the model's first answer."""

    id: str
    task: str
    messages: list[dict]
    extra_turns: list[str] = field(default_factory=list)

    @property
    def user_text(self) -> str:
        """All user-authored text of the prompt (every user message and every extra turn), newline-joined."""
        parts = [m["content"] for m in self.messages if m.get("role") == "user"]
        return "\n".join(parts + list(self.extra_turns))

    def to_json(self) -> dict:
        d = {"id": self.id, "task": self.task, "messages": self.messages}
        if self.extra_turns:
            d["extra_turns"] = list(self.extra_turns)
        return d


def package_data_path(package: str, *parts: str) -> Path:
    """Path of a data file shipped inside an installed package, located without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed (pip install the `data` extra)")
    path = Path(list(spec.submodule_search_locations)[0]).joinpath(*parts)
    if not path.is_file():
        raise FileNotFoundError(f"{package} is installed but its data file {path} is missing")
    return path


def validate_messages(messages, where: str) -> list[dict]:
    """Check a chat message list; return a clean copy (role/content only). Raises ValueError mentioning `where`."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
            raise ValueError(f"{where}: message {i} must be {{'role': one of {ROLES}, 'content': str}}, got {m!r:.200}")
        out.append({"role": m["role"], "content": m["content"]})
    if out[-1]["role"] != "user":
        raise ValueError(f"{where}: the last message must have role 'user' (it is the turn to answer)")
    return out


def parse_prompt_line(obj, where: str, task: str, default_id: str) -> Prompt:
    """Turn one decoded JSONL object (`{"prompt": str}` or `{"messages": [...]}`, optional `id`, `extra_turns`)
    into a Prompt."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        messages = validate_messages(obj["messages"], where)
    elif isinstance(obj.get("prompt"), str):
        messages = [{"role": "user", "content": obj["prompt"]}]
    else:
        raise ValueError(f"{where}: a line needs a 'prompt' string or a 'messages' list")
    extra = obj.get("extra_turns", [])
    if not isinstance(extra, list) or not all(isinstance(t, str) for t in extra):
        raise ValueError(f"{where}: 'extra_turns' must be a list of strings")
    pid = obj.get("id", default_id)
    if not isinstance(pid, (str, int)):
        raise ValueError(f"{where}: 'id' must be a string or an integer")
    return Prompt(id=str(pid), task=task, messages=messages, extra_turns=list(extra))


def iter_jsonl(path: Path):
    """Yield (object, "file:line", line number) for each non-blank line of a JSONL file; a line that is not valid
    JSON (corrupt or truncated) raises ValueError naming the file and the 1-based line number."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                yield json.loads(line), where, lineno
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None


def read_prompts_jsonl(path, task: str) -> list[Prompt]:
    """Read a user prompt JSONL file. Blank lines are skipped; a corrupt or truncated line raises ValueError naming
    the file and the 1-based line number; duplicate ids are rejected."""
    path = Path(path)
    out: list[Prompt] = []
    seen: dict[str, int] = {}
    for obj, where, lineno in iter_jsonl(path):
        p = parse_prompt_line(obj, where, task, default_id=f"{path.stem}/{lineno}")
        if p.id in seen:
            raise ValueError(f"{where}: duplicate id {p.id!r} (first on line {seen[p.id]})")
        seen[p.id] = lineno
        out.append(p)
    return out
