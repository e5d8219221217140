"""The grader pool a runtime opens is the one it closes, whatever a caller puts in `runtime.grader`."""


from rstar2_core.runtime.protocol import OwnedGrader


def test_the_runtime_closes_the_pool_it_opened_and_only_once():
    owned = OwnedGrader()
    pool = owned.open(7.5)
    try:
        assert pool.timeout_s == 7.5
        assert pool.grade_many([("<answer>\\boxed{4}</answer>", "4")])[0].reward == 1.0
        procs = [w.proc for w in pool._workers]
        assert procs and all(p.poll() is None for p in procs)
    finally:
        assert owned.close() is True
    assert all(p.poll() is not None for p in procs)     # every worker process is gone
    assert owned.close() is False                      # a second close does nothing
