"""The attention backends: where the one model (`v41cp.model.Transformer`) reads and writes its keys in a serving step.

* `paged_rows` — cached rows continuing requests over the paged cache (decode, verify, token-serial and span
  prefill; XLA or the Pallas kernels through `kernel_ops`);
* `dcp` — KVP page ownership and DCP attention (exact distributed top-k, LSE-merged partial attention) and the
  plain-TP split selection;
* `qcp_rows` — model-wide QCP: each attention-TP rank its zigzag share of a span prefill's rows;
* `kernel_ops` — the cached rows' attention and index selection through `v41cp.kernels`.
"""
