"""Domain logic: request lifecycle, batches, files, leases + fencing, placement, prices (what
tenants pay), metering (what tokens cost), keys and roles."""
