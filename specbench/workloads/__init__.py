"""What is decoded: datasets and workloads as conversations with categories, and Python sources."""
