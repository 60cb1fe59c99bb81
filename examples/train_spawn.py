"""A small example: four in-memory ranks average gradients of a linear model by hand."""
import torch

from distframe import ReduceOp, spawn


def worker(backend):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    for p in model.parameters():
        backend.broadcast(p.data, src=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1234)
    w_true = torch.randn(8, 1, generator=g)
    for step in range(50):
        x = torch.randn(64, 8, generator=g)[backend.rank::backend.world_size]
        loss = torch.nn.functional.mse_loss(model(x), x @ w_true)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            backend.all_reduce(p.grad, ReduceOp.AVG)
        opt.step()
    return loss.item()


if __name__ == "__main__":
    losses = spawn(worker, world_size=4)
    print("final loss per rank:", [f"{x:.4f}" for x in losses])
