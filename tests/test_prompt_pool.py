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
    assert pool.stats() == {
        "dispatched": 4,
        "released": 1,
        "outstanding": 3,
        "reissued": 0,
        "epoch": 0,
    }


def test_groups_carry_prompt_and_unique_uids_across_epochs():
    pool = make_pool(max_outstanding=100, n=3)
    groups = pool.acquire(7)
    assert len({g.prompt_uid for g in groups}) == 7
    assert sorted(g.prompt_key for g in groups[:3]) == [0, 1, 2]  # each prompt once per epoch
    assert groups[-1].epoch == 2 and all(g.group_size == 4 for g in groups)


def test_a_resumed_pool_continues_the_prompt_order():
    from laminar.prompt_pool import PromptPoolCore
    from laminar.tasks import Prompt

    prompts = [(Prompt(i, f"n {i} >", "x"), (1, i)) for i in range(5)]
    whole = PromptPoolCore(prompts, group_size=2, max_outstanding=100, seed=3)
    first = whole.acquire(12)
    resumed = PromptPoolCore(prompts, group_size=2, max_outstanding=100, seed=3, start=7)
    rest = resumed.acquire(5)
    assert [g.prompt_key for g in rest] == [g.prompt_key for g in first[7:]]
    assert [g.prompt_uid for g in rest] == [g.prompt_uid for g in first[7:]]
    assert [g.epoch for g in rest] == [g.epoch for g in first[7:]]


def test_a_resumed_pool_reissues_the_missing_samples_first():
    """Groups of the stopped run that lacked siblings: handed out again first, with only
    the missing sample indices, counted outstanding from the start (with those the
    buffer holds whole) and not against the new prompts' order."""
    import pytest

    from laminar.errors import DataError

    prompts = [(Prompt(i, f"n {i} >", f"a{i}"), (1, i)) for i in range(5)]
    pool = PromptPoolCore(
        prompts,
        group_size=4,
        max_outstanding=4,
        seed=3,
        start=7,
        outstanding=("p00000002", "p00000005", "p00000006"),
        reissue={"p00000005": (3, 4, (1, 3)), "p00000006": (0, 4, (2,))},
    )
    got = pool.acquire(1)
    assert [(g.prompt_uid, g.prompt_key, g.answer, g.sample_indices) for g in got] == [
        ("p00000005", 3, "a3", (1, 3))
    ]
    got = pool.acquire(5)  # the other re-issued one, then room for one new group
    assert [g.prompt_uid for g in got] == ["p00000006", "p00000007"]
    assert got[0].sample_indices == (2,) and got[1].sample_indices == (0, 1, 2, 3)
    assert pool.stats()["reissued"] == 2 and pool.stats()["outstanding"] == 4
    with pytest.raises(DataError, match="prompt 9, which the dataset no longer has"):
        PromptPoolCore(
            prompts, group_size=4, max_outstanding=4, seed=3, reissue={"p1": (9, 4, (0,))}
        )
