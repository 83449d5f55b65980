"""A small valid bank (three trees, both signals' policies), with any field overridden."""

from __future__ import annotations

from entmtp_ray.calibrate.bank import Bank, BankTree, Hardware, PolicyParams, SignalParams


def make_bank(**overrides) -> Bank:
    trees = [BankTree(name="n1", paths=[], nodes=1, tau=1.0, tokens_per_s=30.0),
             BankTree(name="n3", paths=[[0], [1]], nodes=3, tau_grown=1.6, tau=1.5, tokens_per_s=40.0),
             BankTree(name="n5", paths=[[0], [1], [0, 0], [0, 0, 0]], nodes=5, tau=2.0, tokens_per_s=42.0)]
    fields = dict(model="smollm2-135m-instruct", heads="heads/smollm2-135m-instruct", task="gsm8k",
                  hardware=Hardware(device="cpu", threads=2, dtype="float32", machine="x86_64"),
                  calibration={"source": "gsm8k train", "subset": "tune", "prompts": 100, "seed": 123},
                  created="2026-11-29", trees=trees,
                  policy=PolicyParams(star="n3", signals={
                      "entropy": SignalParams(initial=0.8, ladder_trees=["n5", "n3", "n1"], ladder_thresholds=[0.5, 1.5],
                                              conservative="n3", aggressive="n5", tau_on=0.6, tau_off=1.2),
                      "top1": SignalParams(initial=0.2, ladder_trees=["n5", "n1"], ladder_thresholds=[0.3],
                                           conservative="n1", aggressive="n5", tau_on=0.1, tau_off=0.3)}))
    fields.update(overrides)
    return Bank(**fields)
