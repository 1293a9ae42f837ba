"""Running a session of cells: options, run state, preflight, the cells' servers, known bugs."""
