"""The engine restart budget: at most max_restarts starts within any window, counted again as
old ones age out of it."""

from policies.restarts import RestartBudget


def test_budget_refuses_past_the_limit_within_the_window():
    budget = RestartBudget(max_restarts=2, window_s=60)
    assert budget.take(0.0) and budget.take(10.0)
    assert not budget.take(20.0)
    assert not budget.take(59.9)  # a refused restart is not counted: the window still ends at 60
    assert budget.take(60.0)


def test_restarts_age_out_of_the_window():
    budget = RestartBudget(max_restarts=2, window_s=60)
    assert budget.take(0.0) and budget.take(30.0)
    assert not budget.take(59.9)
    assert budget.take(60.0)  # the first one has left the window
    assert not budget.take(89.9)
    assert budget.take(90.0)


def test_zero_restarts_never_allows_one():
    assert not RestartBudget(max_restarts=0, window_s=60).take(0.0)
