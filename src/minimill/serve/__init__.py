"""`minimill serve`: starts the control plane (the HTTP API, api/) and its local site (a worker
process, site/) and supervises them. Process supervision lives here rather than in api/, which
only answers HTTP."""
