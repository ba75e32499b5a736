import json

import pytest

from blockdraft.prompts import TASKS, load_prompts_file, load_task
from blockdraft.prompts.base import Prompt
from blockdraft.prompts.math import gsm_template_split


def test_counts_and_shapes():
    code = load_task("code")
    chat = load_task("chat")
    math = load_task("math")
    assert len(code) == 164
    assert len(chat) == 80
    assert len(math) >= 200
    assert all(len(p.extra_turns) == 1 for p in chat)
    assert all("def " in p.messages[-1]["content"] for p in code)
    for p in code + chat + math:
        assert isinstance(p, Prompt) and p.task in TASKS
        assert p.messages[-1]["role"] == "user" and p.messages[-1]["content"].strip()
    assert any(p.id.startswith("math/evals-") for p in math)  # word problems from the evals registry


def test_ids_unique():
    ids = [p.id for name in TASKS for p in load_task(name)]
    assert len(ids) == len(set(ids))


def test_deterministic_subset():
    a = load_task("math", n=20, seed=3)
    assert a == load_task("math", n=20, seed=3)
    assert a != load_task("math", n=20, seed=4)
    assert a == load_task("math", seed=3)[:20]  # n takes a prefix of the seeded order
    assert len(load_task("chat", n=5)) == 5
    assert len(load_task("code", n=1000)) == 164
    with pytest.raises(ValueError, match="unknown task"):
        load_task("poetry")


def test_gsm_template_split_disjoint():
    ev, tr = gsm_template_split()
    assert ev and tr and not ev & tr


def test_prompts_file(tmp_path):
    path = tmp_path / "mine.jsonl"
    lines = [json.dumps({"prompt": "hello"}), "",
             json.dumps({"id": "x", "messages": [{"role": "system", "content": "be brief"},
                                                {"role": "user", "content": "hi"}], "extra_turns": ["more"]})]
    path.write_text("\n".join(lines) + "\n")
    ps = load_prompts_file(path)
    assert [p.id for p in ps] == ["mine/1", "x"]
    assert ps[0].messages == [{"role": "user", "content": "hello"}]
    assert ps[1].extra_turns == ["more"]
    path.write_text("\n".join(lines) + '\n{"prompt": "cut off\n')
    with pytest.raises(ValueError, match=r"mine\.jsonl:4"):
        load_prompts_file(path)
    path.write_text(json.dumps({"messages": [{"role": "assistant", "content": "x"}]}) + "\n")
    with pytest.raises(ValueError, match=r"mine\.jsonl:1"):
        load_prompts_file(path)
