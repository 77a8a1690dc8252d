"""The host-synchronisation counter (geomtrain/bench/syncs.py): kinds counted, and the share of an optimizer's step."""

import torch

from geomtrain.bench.syncs import count_host_syncs, counted_in_steps


class ReadingSGD(torch.optim.SGD):
    """SGD whose step reads two numbers on the host (as a solver's checks would)."""

    def step(self, closure=None):
        p = self.param_groups[0]["params"][0]
        float(p.detach().sum())
        bool(torch.isfinite(p.detach()).all())
        return super().step(closure)


def test_kinds_are_counted():
    x = torch.randn(5)
    with count_host_syncs() as counts:
        float(x.sum())
        x[x > 0]
        x.nonzero()
        x.tolist()
        x.cpu()  # free on the CPU, a copy from a GPU: counted whatever the device
    assert counts == {"scalar read": 1, "boolean index": 1, "nonzero": 1, "copy to host": 2}


def test_counted_in_steps_is_the_optimizer_share():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = ReadingSGD([p], lr=0.1)
    with count_host_syncs() as counts, counted_in_steps(opt, counts) as inside:
        float(p.detach().sum())  # outside the step
        opt.step()
        opt.step()
    assert sum(counts.values()) == 5 and inside == [4]
    with count_host_syncs() as counts:  # the hooks are gone after the context
        opt.step()
    assert inside == [4] and sum(counts.values()) == 2
    with count_host_syncs() as counts, counted_in_steps(None, counts) as none:
        opt.step()
    assert none == [0]


def test_a_retraction_reads_the_host_a_fixed_number_of_times_per_batch():
    # near the manifold the polar factor is Newton-Schulz with its step count from one read of the batch's
    # deviations; with the input checks of retr (u) and projx (x + u), and DGram's zero-column check, a batch
    # costs 3 (Stiefel) or 4 (DGram) reads, however many matrices it holds
    from manifolds import DGram, Stiefel

    for manifold, reads in ((Stiefel(), 3), (DGram(), 4)):
        for batch in (1, 6):
            x = manifold.random(batch, 24, 8, dtype=torch.float64)
            u = 1e-2 * manifold.proju(x, torch.randn_like(x))
            with count_host_syncs() as counts:
                y = manifold.retr(x, u)
            assert sum(counts.values()) == reads, (type(manifold).__name__, batch, counts)
            assert manifold.check_point_on_manifold(y)
            with count_host_syncs() as counts, manifold.inputs_checked():  # without the two input checks
                z = manifold.retr(x, u)
            assert sum(counts.values()) == reads - 2 and torch.equal(y, z), (type(manifold).__name__, counts)


def test_a_products_only_step_reads_the_host_a_fixed_number_of_times_per_batch():
    # a ManifoldMuon step with filled_split on one batch of DGram matrices: 8 reads (measured: 7 copies to the
    # host, 1 scalar read) however many matrices the batch holds; the solver leaves its residual on the device
    # and the step reads it with the batch's other values (a .cpu() in the solver made it 9)
    from geomtrain.optim import ManifoldMuon
    from manifolds import DGram

    for k in (1, 4):
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(DGram().random(96, 32, generator=gen)) for _ in range(k)]
        opt = ManifoldMuon([{"params": params, "manifold": DGram()}], lr=0.01, solver="filled_split")
        for _ in range(2):  # the second step is counted
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            with count_host_syncs() as counts, counted_in_steps(opt, counts) as inside:
                opt.step()
        assert inside == [8] and sum(counts.values()) == 8, (k, dict(counts))
        assert opt.last_stats["residual_max"] < 1e-5  # the residual still reaches the statistics
