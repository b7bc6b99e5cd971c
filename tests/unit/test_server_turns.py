"""launch/server_turns.py: what a run takes from its rollout servers' scheduler, and what it refuses (the
servers' /get_world_size/ answers stood in for)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from swiftlite.errors import UserError

URLS = ["http://a:8000", "http://b:8000"]
TOOLS = {"multi_turn_scheduler": "tool_calls", "max_turns": 5, "external_plugins": ["/srv/plugin.py"]}


@pytest.fixture()
def servers(monkeypatch):
    from swiftlite.rlhf import rollout_client
    answers = {}
    monkeypatch.setattr(rollout_client, "server_urls", lambda r: list(answers))
    monkeypatch.setattr(rollout_client, "_get", lambda url, timeout: answers[url.rsplit("/get_world_size/", 1)[0]])
    return answers


def _cfg(rlhf_type="grpo", scheduler=None, max_turns=None):
    return SimpleNamespace(rlhf=SimpleNamespace(use_vllm=True, vllm_mode="server", rlhf_type=rlhf_type,
                                                multi_turn_scheduler=scheduler, max_turns=max_turns))


def test_the_servers_scheduler_is_taken_when_every_server_names_it(servers):
    from swiftlite.launch.server_turns import server_turns
    servers.update({u: {"world_size": 1, **TOOLS} for u in URLS})
    assert server_turns(_cfg()) == TOOLS
    assert server_turns(_cfg(scheduler="tool_calls", max_turns=5)) == TOOLS     # named on both: the same one
    servers.update({u: {"world_size": 1, "multi_turn_scheduler": None} for u in URLS})
    assert server_turns(_cfg()) is None


def test_servers_naming_different_schedulers_are_refused_naming_both(servers):
    from swiftlite.launch.server_turns import server_turns
    servers.update({URLS[0]: {"world_size": 1, **TOOLS}, URLS[1]: {"world_size": 1, **TOOLS, "max_turns": 3}})
    with pytest.raises(UserError, match=r"different multi-turn schedulers \(http://a:8000: --multi_turn_scheduler "
                                        r"tool_calls --max_turns 5; http://b:8000: --multi_turn_scheduler tool_calls "
                                        r"--max_turns 3\)"):
        server_turns(_cfg())
    servers[URLS[1]] = {"world_size": 1}
    with pytest.raises(UserError, match=r"http://b:8000: no scheduler"):
        server_turns(_cfg())


def test_a_run_naming_another_scheduler_or_gkd_is_refused(servers):
    from swiftlite.launch.server_turns import server_turns
    servers.update({u: {"world_size": 1, **TOOLS} for u in URLS})
    with pytest.raises(UserError, match=r"--multi_turn_scheduler math_tip_trick: the rollout server "
                                        r"at http://a:8000 names --multi_turn_scheduler tool_calls --max_turns 5"):
        server_turns(_cfg(scheduler="math_tip_trick"))
    with pytest.raises(UserError, match=r"gkd's sampled steps take --multi_turn_scheduler on the training command"):
        server_turns(_cfg(rlhf_type="gkd"))
