"""What every layer uses: storage paths, processes and host-side reads, the mesh and shardings, the compilation
cache, the command-line plumbing."""
