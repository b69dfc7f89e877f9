"""verl glue: the Ray workers, agl's actor worker, the CPU platform and the supported verl range."""
