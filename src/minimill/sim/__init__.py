"""Fleet simulator and cost model: the same placement and lease rules as the control plane
(control/placement.py, control/lease_rules.py), driven by a virtual clock."""
