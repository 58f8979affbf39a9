from smolctl.cli import main

main()
