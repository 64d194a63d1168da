"""`ladder train`: settings (`settings`), data (`data`), the loop on each rank (`loop`), checkpoints that
never lose work (`checkpoints`), desync's TP ranks simulated for training (`simulate`), loss curves
(`plot`)."""
