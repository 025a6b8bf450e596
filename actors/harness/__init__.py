"""What runs the runtime to judge it: the demo, the chaos harness and its verdict, timeline and
transition reader, and the benchmarks."""
