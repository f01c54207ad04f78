"""What tests and benchmarks both stand up: a coordinator process, a Ray head, a tiny random
model, network namespaces on a bridge with a Ray cluster across them, and a process tree's
memory. Development only: the shipped packages never import it."""
