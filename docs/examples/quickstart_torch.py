from sparkhvd import SparkRunner


def train(epochs):
    import torch
    import torch.distributed as dist
    from sklearn.datasets import load_digits

    dist.init_process_group("gloo")  # torchrun's variables: plain torch.distributed code
    rank, size = dist.get_rank(), dist.get_world_size()
    digits = load_digits()
    x = torch.tensor(digits.data[rank::size] / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target[rank::size])
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(epochs):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return (model(x).argmax(1) == y).float().mean().item()


accuracy = SparkRunner(np=2, backend="torch").run(train, epochs=30)
print(f"accuracy {accuracy:.3f}")
