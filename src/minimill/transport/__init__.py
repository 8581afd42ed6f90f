"""The site-side transport: the wire messages between sites and the control plane (protocol.py
for tokens, box_protocol.py for box hosts, agent_protocol.py for agent runners) and the HTTP
client with retries every site-side part shares (client.py). It sits below fleet/, boxes/ and
agents/, and imports none of them."""
