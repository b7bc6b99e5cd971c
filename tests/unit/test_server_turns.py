"""launch/server_turns.py: what a run takes from its rollout servers' scheduler, and what it refuses (the
servers' /get_world_size/ answers stood in for)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from swiftlite.errors import UserError

URLS = ["http://a:8000", "http://b:8000"]
TOOLS = {"multi_turn_scheduler": "tool_calls", "max_turns": 5, "external_plugins": ["/srv/plugin.py"],
         "use_gym_env": False, "gym_env": None}


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


def test_a_gym_servers_rewards_are_taken_unless_the_run_says_otherwise_and_a_run_needs_some():
    """ms-swift's rule (rollout_mixin.py): the trainer's --use_gym_env, when not given, is the server's."""
    from swiftlite.config.multi_turn_options import taken_turns
    from swiftlite.launch.server_turns import _check_rewards
    gym = {"multi_turn_scheduler": "gym_scheduler", "max_turns": 3, "external_plugins": [], "use_gym_env": True,
           "gym_env": "math_env"}

    def said(use_gym_env=None, reward_funcs=()):
        return SimpleNamespace(parallel=SimpleNamespace(external_plugins=[]), rlhf=SimpleNamespace(
            use_gym_env=use_gym_env, gym_env=None, reward_funcs=list(reward_funcs)))
    taken = taken_turns(said(), gym)
    assert taken["use_gym_env"] is True and taken["gym_env"] == "math_env" and taken["max_turns"] == 3
    assert "use_gym_env" not in taken_turns(said(use_gym_env=False, reward_funcs=["format"]), gym)

    def run(**kw):
        base = dict(rlhf_type="grpo", reward_funcs=[], reward_model=None, teacher_model=None, use_gym_env=None,
                    gym_env=None, reward_weights=None)
        return SimpleNamespace(rlhf=SimpleNamespace(**{**base, **kw}))
    _check_rewards(run(use_gym_env=True))
    _check_rewards(run(reward_funcs=["format"]))
    with pytest.raises(UserError, match="the rollout server gives no gym rewards"):
        _check_rewards(run())
    with pytest.raises(UserError, match="--reward-weights has 1 values"):
        _check_rewards(run(use_gym_env=True, reward_funcs=["format"], reward_weights=[1.0]))
