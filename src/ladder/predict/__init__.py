"""`ladder predict`: a roofline cost model of tensor-parallel generation per residual layout
(`costmodel`), the paper's published numbers it is fitted to and judged on (`paper`), and the fit and
its validation (`fit`)."""
