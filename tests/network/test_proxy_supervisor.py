"""The egress proxy's supervisor: when it gives up restarting, and when it must not."""

from __future__ import annotations

from pathlib import Path

from warmbox.network.supervisor import RESTART_BACKOFF_S, Supervisor


def _supervisor(tmp_path: Path, children: list[tuple[int, int, float | None]]) -> tuple[Supervisor, list[str]]:
    sup = Supervisor(tmp_path, [])
    audited: list[str] = []
    runs = iter(children)
    sup.run_child = lambda: next(runs)  # type: ignore[method-assign]  # (pid, status, seconds it served)
    sup._sleep = lambda _s: None  # type: ignore[method-assign]
    sup.audit_outage = lambda rule, _detail: audited.append(rule)  # type: ignore[method-assign]
    sup.log = lambda _text: None  # type: ignore[method-assign]
    return sup, audited


def test_a_fixed_bad_start_streak_does_not_count_against_the_next_kill(tmp_path):
    """Killed while serving; restarts fail (a broken config) four times; the config is fixed and the
    proxy serves again; then it is killed once more. That kill is restarted: the failed-start
    streak ended when the proxy served (the supervisor used to give up here: egress stayed down)."""
    children = [(1, -9, 5.0)] + [(2 + i, 1, None) for i in range(4)] + [(6, -9, 3.0), (7, 0, 1.0)]
    sup, audited = _supervisor(tmp_path, children)
    assert sup.run() == 0
    assert "proxy-down" not in audited and audited.count("proxy-restart") == 2


def test_a_crash_loop_is_given_up(tmp_path):
    children = [(1 + i, -9, 0.5) for i in range(len(RESTART_BACKOFF_S) + 1)]
    sup, audited = _supervisor(tmp_path, children)
    assert sup.run() == 1
    assert audited[-1] == "proxy-down"


def test_a_start_that_never_serves_is_given_up(tmp_path):
    children = [(1, -9, 5.0)] + [(2 + i, 1, None) for i in range(len(RESTART_BACKOFF_S))]
    sup, audited = _supervisor(tmp_path, children)
    assert sup.run() == 1
    assert audited == ["proxy-restart", "proxy-down"]
