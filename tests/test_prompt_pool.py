from laminar.prompt_pool import PromptPoolCore
from laminar.tasks import Prompt


def make_pool(max_outstanding=3, n=5):
    prompts = [(Prompt(i, f"n {i} >", "x"), (1, i + 4)) for i in range(n)]
    return PromptPoolCore(prompts, group_size=4, max_outstanding=max_outstanding, seed=0)


def test_back_pressure_bounds_outstanding_groups():
    pool = make_pool(max_outstanding=3)
    got = pool.acquire(10)
    assert len(got) == 3 and pool.acquire(1) == []
    pool.release([got[0].prompt_uid, "unknown"])
    assert len(pool.acquire(5)) == 1
    assert pool.stats() == {"dispatched": 4, "released": 1, "outstanding": 3, "epoch": 0}


def test_groups_carry_prompt_and_unique_uids_across_epochs():
    pool = make_pool(max_outstanding=100, n=3)
    groups = pool.acquire(7)
    assert len({g.prompt_uid for g in groups}) == 7
    assert sorted(g.prompt_key for g in groups[:3]) == [0, 1, 2]  # each prompt once per epoch
    assert groups[-1].epoch == 2 and all(g.group_size == 4 for g in groups)
