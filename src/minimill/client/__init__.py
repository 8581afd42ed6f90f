"""The tenant SDK: batches (batches.py), boxes (boxes.py) and agents (agents.py) over the HTTP
API with a tenant's key. It imports no server code: a tenant's program needs only httpx."""
