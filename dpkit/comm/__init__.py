"""Layer 1, communication: ``process_groups`` (set-up, launching, peer failures), ``checks`` (what every
collective refuses before its first message), ``transport`` (the one seam every engine communicates
through) and ``comm_thread`` (a transport's collectives in the background)."""
