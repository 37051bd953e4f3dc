"""Transports: the backends that run collectives between ranks (simulated threads, torch.distributed, same-host shared memory), the rank context, the watchdog and the test launcher."""
