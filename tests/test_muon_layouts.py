"""What each optim.muon_layout costs in collectives: the compiled optimizer step (update and
apply) of a tiny speedrun model in its run's shardings on 8 CPU devices, its collectives counted
as nanotext.compile counts them (a loop's as often as it goes round)."""

import collections

import jax
import optax

from conftest import SPEEDRUN, TINY
from nanotext import hlo, hlo_loops, sharding, wiring


def optimizer_collectives(*overrides) -> tuple:
  """({op: count} of one compiled optimizer step, {op: count} of those inside a loop)."""
  run = wiring.prepare(SPEEDRUN, TINY + ["model.mlp_dim=0"] + list(overrides))
  params, opt = run.state_shardings["params"], run.state_shardings["opt_state"]

  def step(p, state, grads):
    with sharding.use_rules(run.rules, run.mesh):
      updates, state = run.tx.update(grads, state, p)
      return optax.apply_updates(p, updates), state
  state = run.abstract_state()
  text = jax.jit(step, in_shardings=(params, opt, params), out_shardings=(params, opt)).lower(
      state["params"], state["opt_state"], state["params"]).compile().as_text()
  comps, entry = hlo.parse(text)
  runs = hlo_loops.runs(comps, entry)
  every, looped = collections.Counter(), collections.Counter()
  for name, instrs in comps.items():
    n = runs.get(name, 1)
    for ins in instrs:
      op = ins.opcode.removesuffix("-start")  # an async pair counts once, at its start
      if op in hlo.COLLECTIVES:
        every[op] += n
        looped[op] += n if n > 1 else 0
  return every, +looped


def test_replicated_newton_schulz_runs_without_collectives_under_fsdp():
  """replicated: each device orthogonalises whole matrices. Its results left unpinned, XLA took
  the FSDP sharding of the parameters back into the Newton-Schulz loop: 100 collectives in its
  iterations here, as many as the sharded layout's (speedrun.yml's train step on v6e-8: 350
  all-gathers and 55 all-reduces in the loop)."""
  _, looped = optimizer_collectives("mesh.fsdp=8", "optim.muon_layout=replicated")
  assert not looped, looped


def test_distributed_muon_under_data_parallelism_only_gathers_its_results():
  """Every device holds every gradient whole: each slices its share of the spread stacks where it
  is and only the orthogonalised results travel. The stacks were built by XLA's partitioned
  concatenate instead: 11 all-to-alls and an all-reduce here (speedrun.yml's train step: 30
  collective-permutes on v6e-8, 49 all-to-alls on h100-8, and larger gradient all-reduces)."""
  every, _ = optimizer_collectives("mesh.data=8", "mesh.fsdp=1")
  assert set(every) == {"all-gather"}, every


def test_distributed_muon_under_fsdp_gathers_nothing_whole():
  """Each orthogonalised matrix goes from the device that made it to its parameter's FSDP shards
  (all-to-alls). Pinned replicated, every result was gathered whole onto every device only for
  the update to slice its shard again: 3 all-gathers here, 352 MiB per device a step at
  speedrun.yml's size (v6e-8 and h100-8)."""
  every, _ = optimizer_collectives("mesh.fsdp=8")
  assert "all-gather" not in every and every["all-to-all"], every
