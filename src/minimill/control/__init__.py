"""Domain logic: request lifecycle, batches, files, leases + fencing, placement, metering."""
