"""CPU µs per streamed output on the pipe between the engine core and the API process: the full packed form
against the flat one of a plain delta (core_protocol.pack_output ``continued``). Core side: pack a step's 256
outputs and pickle the StepOutputs; API side: unpickle it and unpack each output. Six alternating runs."""
import statistics
import time

from cllm.engine.core_protocol import StepOutputs, decode, encode, is_delta, pack_output, unpack_delta, unpack_output
from cllm.outputs import CompletionOutput, RequestMetrics, RequestOutput, Usage

B, STEPS = 256, 200
PROMPT = list(range(300, 450))


def outputs(step: int) -> list[RequestOutput]:
    return [RequestOutput(f"cmpl-{j:032x}-0", None, PROMPT,
                          [CompletionOutput(0, "", [], None, None, None, " word", [1000 + step])], False,
                          Usage(len(PROMPT), step + 1, 0), RequestMetrics(1.0, 1.1, 1.2, 1.2 + step / 200), None, None)
            for j in range(B)]


def run(continued: bool) -> tuple[float, float]:
    steps = [outputs(i) for i in range(STEPS)]
    previous = unpack_output(pack_output(steps[0][0]), None, PROMPT)
    t0 = time.process_time()
    frames = [encode(StepOutputs([pack_output(o, continued=continued) for o in step], None)) for step in steps]
    core = time.process_time() - t0
    t0 = time.process_time()
    for frame in frames:
        for packed in decode(frame).outputs:
            unpack_delta(packed, previous) if is_delta(packed) else unpack_output(packed, None, PROMPT)
    api = time.process_time() - t0
    return core / (B * STEPS) * 1e6, api / (B * STEPS) * 1e6


def main() -> None:
    res: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for r in range(6):
        for continued in (False, True) if r % 2 == 0 else (True, False):
            res[continued].append(run(continued))
    for continued, runs in res.items():
        name = "flat delta" if continued else "full form "
        print(f"{name}: core (pack + pickle) {statistics.median(c for c, _ in runs):.2f} µs/output, "
              f"API (unpickle + unpack) {statistics.median(a for _, a in runs):.2f} µs/output   "
              f"runs: {[(round(c, 2), round(a, 2)) for c, a in runs]}")


if __name__ == "__main__":
    main()
