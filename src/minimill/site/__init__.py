"""A site's assembly: the worker process that starts a site's parts together (the fleet's
lease loop and engine, a box host, an agent runner) and stops them together. It sits above
fleet/, boxes/ and agents/, and holds no logic of its own beyond starting and stopping them."""
