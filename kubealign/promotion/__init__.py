"""What decides and moves the registry's aliases: the gate, the aliases with their journal, the lease,
the registered versions. kubealign.stages.promote (and the canary, later) use them."""
