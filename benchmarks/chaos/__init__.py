"""`pdserve bench chaos`: a soak of 2 prefill + 2 decode workers and a router under steady
Poisson load while faults strike, judged against a colocated oracle.

- `plan`: the prompts, the arrival times and the fault schedule (pure, seeded).
- `cluster`: the nodes as processes, restarted on their ports, memory per incarnation.
- `faults`: SIGKILL and restart, SIGSTOP past the lease, router restart, a blocked link.
- `firewall`: the link fault's iptables rules, always removed.
- `traffic`: greedy requests with deadlines: oracle, capacity, the open loop.
- `pools`: pages leaked once the faults stop (Worker.GetLoad).
- `report`: the verdict and its must-be-0 checks.
- `cli`: the command line (`python -m pdserve.benchmarks.chaos`).
"""
