"""Crash-consistency harness for durable stores (issue 38): `crash.harness` (kills), `crash.powerloss` (power-loss
model), `crash.oracle` (what a restore must hold), `crash.workload` (what the killed processes do)."""
