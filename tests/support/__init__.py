"""What the tests share: launching ranks and simulated hosts, inputs, independent oracles, servers to start."""
