"""The `starscream` command (`main`), one module per subcommand (arguments and printing only), the arguments they
share (`arguments`) and number formatting (`format`)."""
