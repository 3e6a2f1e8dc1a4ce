"""Conformance rules that HostBackend and CudaBackend do not pass yet, each with the
reason; the tests skip them (and expect the clean HostBackend to fail exactly these).
Empty it when the reason is gone."""

PENDING = {
    "reduce_bf16_correctly_rounded": "exact (fixed-point) sums arrive with the DRIVER branch",
}
