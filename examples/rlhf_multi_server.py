"""RLHF with several rlserve servers behind a router and one trainer, on CPUs (gloo).

The loop of an RL post-training job at fleet scale, shrunk to one machine:

- ``--servers`` rlserve servers (dummy weights, ``--weight-staging host``), each its own process;
- the SGLang router (``pip install 'rlserve[router]'``) in front of them, prefix-cache-aware;
- a trainer (Hugging Face transformers, float32) that joins every server into ONE transfer group
  (trainer rank 0, each server at its ``rank_offset``) and pushes its weights into all of them
  with one ``send_weights()`` per round.

Each round: rollouts (greedy completions of the prompts) through the router; they must equal the
trainer's own ``generate`` (the servers serve exactly its weights); a training step (one SGD step
on the rollouts' log-likelihood, so the weights really change); then pause every server
(``keep``: requests freeze, new ones are held), sync, resume. After each sync every server must
report the same weight version. Prints ``OK`` at the end (exit status 3 on a mismatch).

Run:
    $ python examples/rlhf_multi_server.py [--model DIR] [--servers 2] [--rounds 3] [--max-tokens 8]
    $ python examples/rlhf_multi_server.py --model DIR --server-url URL1 --server-url URL2 --router-url URL \
          [--admin-key KEY]          # servers and router already running (e.g. placed by Ray)

``--model default`` is SmolLM2-135M-Instruct (``rlserve download``); any local Hugging Face
directory works. On a cluster, the servers would come from ``rlserve.scaleout.ray_launcher``
and the trainer would pass ``backend="nccl"``: the rest is the same.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

import torch

from rlserve.demo import PROMPTS, complete, compare_completions, load_trainer_model, trainer_greedy
from rlserve.download import resolve_model
from rlserve.scaleout.local import LocalServers
from rlserve.scaleout.router import SGLangRouter
from rlserve.transfer import ModuleSource
from rlserve.transfer.sdk.multi_server import MultiServerTrainer


def rollouts_through_router(router_url: str, model_name: str, prompts, max_tokens: int):
    """One request per prompt, all at once, through the router (which spreads them over the
    servers); greedy, with token ids."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(prompts)) as pool:
        return [c for cs in pool.map(lambda p: complete(router_url, [p], max_tokens, model=model_name), prompts)
                for c in cs]


def training_step(model, rollouts, lr: float) -> float:
    """One SGD step on the mean negative log-likelihood of the rollouts' completions (given
    their prompts): a stand-in for the policy update. Returns the loss."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    opt.zero_grad()
    losses = []
    for r in rollouts:
        ids = torch.tensor([r.prompt_token_ids + r.token_ids])
        logits = model(ids).logits[0, len(r.prompt_token_ids) - 1:-1]
        losses.append(torch.nn.functional.cross_entropy(logits.float(), torch.tensor(r.token_ids)))
    loss = torch.stack(losses).mean()
    loss.backward()
    opt.step()
    model.eval()
    return float(loss.detach())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="a local Hugging Face model directory, or 'default'")
    ap.add_argument("--servers", type=int, default=2, help="how many rlserve servers")
    ap.add_argument("--rounds", type=int, default=3, help="rollout / train / sync rounds")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens per rollout")
    ap.add_argument("--lr", type=float, default=1e-2, help="SGD learning rate of the training step")
    ap.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
    ap.add_argument("--log-dir", default=None, help="directory for the servers' and the router's logs")
    ap.add_argument("--server-url", action="append", default=None,
                    help="a running server to use instead of starting --servers (repeatable; needs --router-url)")
    ap.add_argument("--router-url", default=None, help="the running SGLang router in front of --server-url")
    ap.add_argument("--admin-key", default=None, help="the servers' --admin-key")
    args = ap.parse_args()
    prompts = args.prompt or list(PROMPTS)
    if bool(args.server_url) != bool(args.router_url):
        ap.error("--server-url and --router-url go together")

    path = resolve_model(args.model)
    model = load_trainer_model(path)
    with contextlib.ExitStack() as stack:
        if args.server_url:
            urls, router = args.server_url, SGLangRouter.attach(args.router_url)
        else:
            t0 = time.perf_counter()
            servers = stack.enter_context(LocalServers(path, args.servers, staging="host", log_dir=args.log_dir))
            router = stack.enter_context(SGLangRouter(
                servers.urls, log_path=None if args.log_dir is None else f"{args.log_dir}/router.log"))
            urls = servers.urls
            print(f"started {args.servers} servers and the router ({time.perf_counter() - t0:.1f} s)", flush=True)
        print(f"servers {urls} behind the router {router.url}", flush=True)
        return run(model, path, urls, router, prompts, args)


def run(model, path: str, urls, router, prompts, args) -> int:
    """The rounds (see the module docstring); 0 when everything matched, 3 otherwise."""
    trainer = MultiServerTrainer.create(urls, ModuleSource(model), router=router, admin_key=args.admin_key)
    try:
        print(f"transfer group: trainer rank 0 at {trainer.engine.init_info.master_address}, "
              f"server rank offsets {trainer.client.rank_offsets()}", flush=True)
        out = trainer.send_weights()  # the servers start with dummy weights
        print(f"initial sync: version {out['weight_version']} on every server "
              f"({trainer.last_stats['total_seconds']:.2f} s)", flush=True)
        for rnd in range(1, args.rounds + 1):
            rollouts = rollouts_through_router(router.url, path, prompts, args.max_tokens)
            mism = compare_completions(rollouts, trainer_greedy(model, [r.prompt_token_ids for r in rollouts],
                                                                args.max_tokens))
            versions = {r.weight_version for r in rollouts}
            if mism:
                print(f"round {rnd}: {len(mism)} rollout(s) differ from the trainer's greedy output: "
                      f"{[(m.prompt, m.first_difference) for m in mism]}", flush=True)
                return 3
            loss = training_step(model, rollouts, args.lr)
            trainer.pause("keep")  # every server: running requests freeze, new ones are held
            try:
                out = trainer.send_weights()
            finally:
                trainer.resume()
            seen = trainer.weight_versions()
            print(f"round {rnd}: {len(rollouts)} rollouts on version(s) {sorted(versions)} equal the "
                  f"trainer's; loss {loss:.4f}; synced version {out['weight_version']} into "
                  f"{len(seen)} servers in {trainer.last_stats['total_seconds']:.2f} s: {seen}", flush=True)
            if set(seen.values()) != {out["weight_version"]}:
                print(f"servers disagree on the weight version: {seen}", flush=True)
                return 3
        final = rollouts_through_router(router.url, path, prompts, args.max_tokens)
        if compare_completions(final, trainer_greedy(model, [r.prompt_token_ids for r in final],
                                                     args.max_tokens)):
            print("after the last sync the router's completions differ from the trainer's", flush=True)
            return 3
    finally:
        trainer.shutdown()
    print("OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
