import pytest

from laminar.cluster import place, workers_with
from laminar.errors import ClusterError


def test_placement_needs_role_resources(small_config):
    from distributed import Client, LocalCluster

    import pipelines

    with (
        LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        assert workers_with(client, "rollout") == []
        with pytest.raises(
            ClusterError, match=r"0 worker\(s\) with resource 'data'.*--resources data=1"
        ):
            pipelines.submit(small_config, client, overrides=["cluster.placement_timeout_s=0"])


@pytest.mark.slow
def test_local_cluster_gives_each_role_its_own_worker(cluster_client):
    rollouts = place(cluster_client, "rollout", 2)
    trainer = place(cluster_client, "trainer", 1)
    assert len(set(rollouts)) == 2 and trainer[0] not in rollouts
    assert place(cluster_client, "data", 1) == trainer  # data module beside the trainer
    with pytest.raises(ClusterError, match="needs 3"):
        place(cluster_client, "rollout", 3)
